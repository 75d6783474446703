"""Fill the dispatcher's rule table with every family's rules and special handlers."""

from __future__ import annotations

from ..arrays import rule_table
from . import (attention_kernels, batch_norm, distances, embedding_bag, foreach, fused, indexing, loss,
               masked_softmax, matrix, native_mha, nn, pointwise, quantized, reductions, segments, strided,
               sync_batch_norm, views)

for _family in (pointwise, matrix, quantized, reductions, views, strided, indexing, nn, attention_kernels, foreach, fused,
                batch_norm, embedding_bag, distances, masked_softmax, native_mha, segments):
    rule_table.install(_family.TABLE)
rule_table.set_pointwise_rule(pointwise.POINTWISE)
rule_table.SPECIAL.update(loss.SPECIAL)
rule_table.SPECIAL.update(foreach.SPECIAL)
rule_table.SPECIAL.update(sync_batch_norm.SPECIAL)
