"""shardfn's redistribution plans against DTensor's planners, case by case.

Corpus: meshes (4,), (2, 2), (2, 4); float32 shapes from tiny and uneven to > 64 KiB;
per mesh dim a source placement in {R, S(0), S(1), P(sum), P(max)} (one Partial kind per
case, as DTensor requires) and a destination in {R, S(0), S(1)}. For each case:

- shardfn: ``plan_redistribute`` -> bytes the busiest device sends, collectives; with
  ``--check`` the plan also runs on the local backend and must give the exact value; with
  ``--check-dist`` every case on a mesh of at most 4 devices runs on the dist backend
  (4 gloo processes) and must give the exact value there too.
- DTensor: both planners (``_gen_transform_infos`` greedy and graph-based), each step
  costed like shardfn's steps (ring: all_gather (g-1) x padded shard, all_reduce
  2 (g-1)/g x size, reduce_scatter (g-1) x padded shard, all_to_all (g-1) x padded
  piece); the better of the two per case ("DTensor's better planner").

Targets (issue 14): never more bytes than DTensor, and never more collectives than
DTensor where the tensor is small (< 64 KiB). ``python tools/dtensor_redistribute_compare.py
[--check] [--check-dist]`` prints the totals and every losing case; ``cases()``/``compare()`` are used
by tests/test_plan.py on a sample.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import zlib
from pathlib import Path

import torch

MESHES = [((4,), ("x",)), ((2, 2), ("x", "y")), ((2, 4), ("x", "y"))]
SHAPES = [(8, 8), (7, 5), (3, 2), (1, 9), (64, 48), (255, 130)]
SRC = ("R", "S0", "S1", "Psum", "Pmax")
DST = ("R", "S0", "S1")
SMALL = 64 * 1024
ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # this checkout's shardfn, not an installed one
    sys.path.insert(0, str(ROOT))


def cases() -> list[tuple]:
    """(mesh shape, axis names, shape, src codes, dst codes) for every case."""
    out = []
    for (mshape, names), shape in itertools.product(MESHES, SHAPES):
        for src in itertools.product(SRC, repeat=len(mshape)):
            if len({p for p in src if p.startswith("P")}) > 1:
                continue  # DTensor allows one Partial kind
            for dst in itertools.product(DST, repeat=len(mshape)):
                out.append((mshape, names, shape, src, dst))
    return out


def _sf_placements(codes: tuple):
    from shardfn.values.spec import Partial, Replicate, Shard

    return tuple(Replicate() if c == "R" else Shard(int(c[1])) if c[0] == "S" else Partial(c[1:]) for c in codes)


def _dt_placements(codes: tuple):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return tuple(Replicate() if c == "R" else Shard(int(c[1])) if c[0] == "S" else Partial(c[1:]) for c in codes)


def shardfn_cost(case: tuple) -> tuple[int, int]:
    """(bytes, collectives) of shardfn's plan."""
    import shardfn as sf

    mshape, names, shape, src, dst = case
    mesh = sf.Mesh(mshape, names, backend="local")
    plan = sf.plan_redistribute(_sf_placements(src), _sf_placements(dst), shape, mesh=mesh)
    return plan.bytes_per_device, plan.collectives


def check_exact(case: tuple, backend: str = "local") -> None:
    """Run the plan on ``backend`` from a source with that layout; compare."""
    import shardfn as sf

    mshape, names, shape, src, dst = case
    mesh = sf.Mesh(mshape, names, backend=backend)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(repr(case).encode())))
    x = sf.reshard(sf.distribute(full, sf.P(), mesh=mesh), _sf_placements(src))
    y = sf.reshard(x, _sf_placements(dst))
    if not torch.equal(y.full_tensor(), full):
        raise AssertionError(f"{case}: inexact result")


def dtensor_cost(case: tuple) -> tuple[int, int]:
    """(bytes, collectives) of DTensor's better planner (fewer bytes, then collectives)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _dtensor_ref as ref

    mshape, names, shape, src, dst = case
    mesh = ref.make_mesh(mshape, names)
    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
    s = DTensorSpec(mesh, _dt_placements(src), tensor_meta=meta)
    d = DTensorSpec(mesh, _dt_placements(dst), tensor_meta=meta)
    best = None
    for graph in (False, True):
        try:
            infos = _gen_transform_infos_non_cached(s, d, graph)
        except Exception:  # a planner that cannot do this case
            continue
        cost = _dt_steps_cost(infos, mshape)
        best = cost if best is None or cost < best else best
    if best is None:
        raise RuntimeError(f"DTensor cannot plan {case}")
    return best


def _dt_steps_cost(infos: list, mshape: tuple) -> tuple[int, int]:
    total, n = 0, 0
    for info in infos:
        g = mshape[info.mesh_dim]
        a, b = info.src_dst_placements
        shp = list(info.logical_shape)
        numel = math.prod(shp)
        if a.is_shard() and b.is_replicate():
            i = a.dim
            sent = (g - 1) * -(-shp[i] // g) * (numel // max(shp[i], 1)) * 4
        elif a.is_partial() and b.is_replicate():
            sent = 2 * (g - 1) * numel * 4 // g
        elif a.is_partial() and b.is_shard():
            i = b.dim
            sent = (g - 1) * -(-shp[i] // g) * (numel // max(shp[i], 1)) * 4
        elif a.is_shard() and b.is_shard():
            i, j = a.dim, b.dim
            rest = numel // max(shp[i] * shp[j], 1)
            sent = (g - 1) * -(-shp[i] // g) * -(-shp[j] // g) * rest * 4
        else:
            continue  # local: slice, mark pending
        total += sent
        n += 1
    return total, n


def compare(sample: list[tuple], check: bool = False) -> dict:
    """Totals and losing cases over ``sample``."""
    more_bytes, more_colls = [], []
    ours_b = theirs_b = 0
    for case in sample:
        ob, oc = shardfn_cost(case)
        tb, tc = dtensor_cost(case)
        ours_b, theirs_b = ours_b + ob, theirs_b + tb
        if ob > tb:
            more_bytes.append((case, (ob, oc), (tb, tc)))
        if oc > tc and math.prod(case[2]) * 4 < SMALL:
            more_colls.append((case, (ob, oc), (tb, tc)))
        if check:
            check_exact(case)
    return {"cases": len(sample), "bytes": ours_b, "dtensor_bytes": theirs_b,
            "more_bytes": more_bytes, "more_collectives_small": more_colls}


DIST_WORLD = 4


def _dist_rank(rank: int, port: int, out: str) -> None:
    """One gloo rank: every case on a mesh of at most DIST_WORLD devices; rank 0 writes
    the failures to ``out``."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=DIST_WORLD)
    failures, n = [], 0
    for case in cases():
        if math.prod(case[0]) != DIST_WORLD:
            continue
        n += 1
        try:
            check_exact(case, "dist")
        except AssertionError as e:
            failures.append(str(e))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(f"{n}\n" + "\n".join(failures))


def check_dist() -> tuple[int, list[str]]:
    """(cases run, failures) of every case on a 4-device mesh, run on 4 gloo processes."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_dist_rank, args=(port, out), nprocs=DIST_WORLD)
        n, *failures = Path(out).read_text().split("\n")
    return int(n), [f for f in failures if f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="also run every plan and compare values")
    parser.add_argument("--check-dist", action="store_true",
                        help="also run every case on a 4-device mesh on 4 gloo processes and compare values")
    args = parser.parse_args()
    if args.check_dist:
        n, failures = check_dist()
        print(f"dist backend (4 gloo processes): {n} cases run, {len(failures)} inexact")
        for f in failures[:40]:
            print(f"  inexact on dist: {f}")
    r = compare(cases(), args.check)
    print(f"cases: {r['cases']}; bytes shardfn / DTensor: {r['bytes'] / max(r['dtensor_bytes'], 1):.4f} "
          f"({r['bytes']} / {r['dtensor_bytes']} B); cases with more bytes than DTensor: {len(r['more_bytes'])}; "
          f"cases with more collectives on < 64 KiB: {len(r['more_collectives_small'])}"
          + ("; every result exact" if args.check else ""))
    for name in ("more_bytes", "more_collectives_small"):
        for case, ours, theirs in r[name][:40]:
            print(f"  {name}: {case}: shardfn (bytes, collectives) {ours}, DTensor {theirs}")


if __name__ == "__main__":
    main()
