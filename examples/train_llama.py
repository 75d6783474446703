"""Train a small Llama end to end: shard, train, checkpoint, resume elsewhere, load HF weights.

1. The model (plain torch, Hugging Face's Llama parameter names) is built on the meta
   device and sharded by ``sf.nn.shard_params`` on a simulated (dp=2, tp=2) mesh:
   Megatron tensor parallelism over 'tp', the batch over 'dp'.
2. Training: fp32 master weights, the forward/backward in bf16 (a differentiable cast),
   gradient accumulation over micro-batches, ``sf.optim.clip_grad_norm`` and
   ``sf.optim.AdamW``, all pure functions of pytrees.
3. ``sf.checkpoint.save`` writes parameters, optimizer state and the step (DCP's format,
   each distinct shard once).
4. Resume on another mesh shape (dp=1, tp=4) and on the dist backend (4 gloo processes on
   the original shape): ``sf.checkpoint.load`` reshards on load; the next step's loss
   matches the uninterrupted run.
5. Load Hugging Face safetensors weights straight into sharded arrays
   (``HuggingFaceStorageReader``).

Run: python examples/train_llama.py
The dist resume spawns 4 processes of this file; under torchrun the same worker runs as
``torchrun --nproc-per-node 4 examples/train_llama.py --worker CHECKPOINT_DIR``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
import warnings

import optree
import torch
import torch.nn.functional as F
from torch import nn

import shardfn as sf
from shardfn import P

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ = 128, 64, 4, 128, 2, 16
BATCH, MICRO = 8, 2  # global batch per micro-step, micro-steps per optimizer step
STEPS, SAVE_AT = 4, 2

# -- the model: plain torch, Hugging Face Llama parameter names ------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, HEADS, DIM // HEADS).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, DIM))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(DIM, eps=1e-6), nn.RMSNorm(DIM, eps=1e-6)
        self.self_attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model, self.lm_head = Body(), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


# Megatron TP over 'tp': q/k/v/gate/up split by output rows, o/down by input columns; the
# rest replicated. (nn.Linear weights are (out, in).)
RULES = [
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("tp", None)),
    (r"(o_proj|down_proj)\.weight$", P(None, "tp")),
    (r".", P()),
]


def shardings(model: nn.Module, mesh: sf.Mesh) -> dict[str, sf.NamedSharding]:
    """Each parameter's sharding on ``mesh`` by RULES (what a checkpoint is loaded into)."""
    return {name: sf.NamedSharding(mesh, next(spec for rx, spec in RULES if re.search(rx, name)))
            for name, _ in model.named_parameters()}


# -- training: pure functions of pytrees --------------------------------------------------------


def batch(step: int, micro: int, mesh: sf.Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of token ids (a learnable pattern: next token = token + 1), split over 'dp'."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return sf.distribute(seq[:, :-1], P("dp"), mesh=mesh), sf.distribute(seq[:, 1:], P("dp"), mesh=mesh)


def loss_fn(params: dict, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    low = optree.tree_map(lambda p: p.to(torch.bfloat16), params)  # bf16 compute, fp32 master weights
    logits = torch.func.functional_call(model, low, (tokens,))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(params: dict, state: dict, step: int, model: nn.Module, opt: sf.optim.AdamW,
               mesh: sf.Mesh) -> tuple[dict, dict, float]:
    grads, total = None, 0.0
    for micro in range(MICRO):  # gradient accumulation
        tokens, targets = batch(step, micro, mesh)
        g, loss = torch.func.grad_and_value(loss_fn)(params, model, tokens, targets)
        grads = g if grads is None else optree.tree_map(torch.add, grads, g)
        total += loss.item() / MICRO
    grads = optree.tree_map(lambda g: g / MICRO, grads)
    grads, _ = sf.optim.clip_grad_norm(grads, 1.0)
    params, state = opt.step(params, grads, state)
    return params, state, total


def resume(path: str, model: nn.Module, opt: sf.optim.AdamW, mesh: sf.Mesh) -> tuple[dict, dict, int]:
    """Parameters, optimizer state and step from a checkpoint, laid out for ``mesh``."""
    like_params = shardings(model, mesh)
    state_like = opt.init({k: sf.zeros(shape_of(model, k), sharding=s) for k, s in like_params.items()})
    ck = sf.checkpoint.load(path, {"params": like_params, "opt": state_like, "step": 0})
    return ck["params"], ck["opt"], ck["step"]


def shape_of(model: nn.Module, name: str) -> tuple[int, ...]:
    return tuple(model.get_parameter(name).shape)


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return Llama()


# -- the dist resume: one process per device -----------------------------------------------------


def worker(path: str) -> None:
    """Resume on the dist backend (one process per device of a (2, 2) mesh) and run one step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="dist")
        model, opt = meta_model(), sf.optim.AdamW(lr=3e-3, weight_decay=0.1)
        params, state, step = resume(path, model, opt, mesh)
        _, _, loss = train_step(params, state, step, model, opt, mesh)
        if dist.get_rank() == 0:
            with open(os.path.join(path, "dist_loss.txt"), "w") as f:
                f.write(repr(loss))
    finally:
        dist.destroy_process_group()


def run_dist(path: str) -> float:
    """Spawn 4 worker processes of this file (what torchrun would do) and read their loss."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="4")
    src = os.path.dirname(os.path.dirname(os.path.abspath(sf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", path],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(4)]
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        raise RuntimeError(f"dist workers exited with {codes}")
    with open(os.path.join(path, "dist_loss.txt")) as f:
        return float(f.read())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the tour -------------------------------------------------------------------------------------


def main(dist_resume: bool = True) -> dict:
    torch.manual_seed(0)
    # single process: every device simulated here (the dist part spawns its own processes)
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    model = meta_model()
    params = sf.nn.shard_params(model, RULES, mesh=mesh, key=sf.random.key(0))
    opt = sf.optim.AdamW(lr=3e-3, weight_decay=0.1)
    state = opt.init(params)
    root = tempfile.mkdtemp(prefix="train-llama-")
    ckpt = os.path.join(root, "step2")
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            sf.checkpoint.save(ckpt, {"params": params, "opt": state, "step": step})
            print(f"saved step {step} to {ckpt}")
        params, state, loss = train_step(params, state, step, model, opt, mesh)
        losses.append(loss)
        print(f"step {step}: loss {loss:.4f}")
    assert losses[-1] < losses[0], losses

    # resume on another mesh shape: everything resharded on load
    other = sf.Mesh((1, 4), ("dp", "tp"), backend="local")
    p2, s2, step = resume(ckpt, model, opt, other)
    assert p2["model.layers.0.self_attn.q_proj.weight"].mesh == other
    _, _, loss2 = train_step(p2, s2, step, model, opt, other)
    print(f"resumed on (dp=1, tp=4): step {step} loss {loss2:.4f} (uninterrupted: {losses[step]:.4f})")
    assert math.isclose(loss2, losses[step], rel_tol=2e-2), (loss2, losses[step])

    out = {"losses": losses, "resumed": loss2}
    if dist_resume:
        loss3 = run_dist(ckpt)
        print(f"resumed on 4 gloo processes: step {step} loss {loss3:.4f}")
        assert math.isclose(loss3, losses[step], rel_tol=2e-2), (loss3, losses[step])
        out["dist"] = loss3

    # Hugging Face weights (safetensors, HF names) straight into sharded arrays
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    weights = {k: v.full_tensor().to(torch.bfloat16) for k, v in params.items()}
    save_file(weights, os.path.join(hf, "model.safetensors"))
    loaded = sf.checkpoint.load(hf, {k: sf.zeros(tuple(v.shape), sharding=v.sharding) for k, v in params.items()},
                                storage_reader=HuggingFaceStorageReader(hf))
    for k, v in weights.items():
        assert torch.equal(loaded[k].full_tensor(), v.float()), k
    print(f"loaded {len(loaded)} tensors from {hf}/model.safetensors, e.g. "
          f"model.layers.0.mlp.down_proj.weight {loaded['model.layers.0.mlp.down_proj.weight'].sharding}")
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        worker(sys.argv[2])
    else:
        main()
