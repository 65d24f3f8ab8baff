"""The token embedding and the logits head, their vocabulary split over tensor-parallel ranks.

Rank r holds rows ``r*n : (r+1)*n`` of the ``[V, H]`` matrix, ``n = ceil(V / ranks)``; the last
rank's rows past V are zeros (one rank: exactly ``[V, H]``, no padding). A lookup finds each
token on the one rank that holds its row (the others contribute zeros) and sums over ranks; the
head computes each rank's logits for its rows and gathers them, dropping the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

from .linear import WeightShapeError, default_weight_loader


class VocabShard:
    """Which vocabulary rows one rank holds."""

    def __init__(self, vocab_size: int, rank: int, size: int) -> None:
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // size)  # every rank's row count, padding included
        self.start = min(rank * self.rows, vocab_size)
        self.end = min(self.start + self.rows, vocab_size)  # rows start:end are real tokens

    def load(self, param: torch.Tensor, loaded: torch.Tensor, dim: int = 0, packed: int = 1) -> None:
        """The whole checkpoint tensor -> this rank's rows, zero padding after them. The vocabulary
        runs along ``dim`` (0 for a dense ``[V, H]``; a quantized head's packed tensors may hold it
        along another, e.g. GPTQ's ``qweight [H / 8, V]``), ``packed`` vocabulary rows to an element
        (GPTQ's ``qzeros [G, V / 8]``)."""
        if self.rows % packed or self.vocab_size % packed:
            raise QuantizationError(f"the head's vocabulary of {self.vocab_size} rows, {self.rows} a rank, does not "
                                    f"split into whole packed elements of {packed} rows")
        expected = (*param.shape[:dim], self.vocab_size // packed, *param.shape[dim + 1:])
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(tuple(loaded.shape), expected)
        start, end = self.start // packed, self.end // packed
        param.data.narrow(dim, 0, end - start).copy_(loaded.narrow(dim, start, end - start))
        param.data.narrow(dim, end - start, param.shape[dim] - (end - start)).zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.prefix = num_embeddings, embedding_dim, prefix
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.shard = VocabShard(num_embeddings, self.tp_rank, self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, embedding_dim, dtype=params_dtype),
                                   requires_grad=False)  # [V / ranks, H]
        set_weight_attrs(self.weight, output_dim=0, weight_loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        self.shard.load(param, loaded_weight)

    def lookup_local(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]: zeros for other ranks' tokens
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        rows = F.embedding((input_ids - self.shard.start) * mine, self.weight)  # other ranks' tokens: row 0
        return rows.masked_fill(~mine.unsqueeze(-1), 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.tp_size == 1:  # built for one rank (a draft model beside a sharded one): no peers
            return self.lookup_local(input_ids)
        return all_reduce(self.lookup_local(input_ids))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={self.shard.start}:{self.shard.end}"


class ParallelLMHead(nn.Module):
    """``logits = hidden @ W^T`` over the vocabulary; W ``[V, H]`` split by rows like the embedding.

    ``tied``: the model's embedding, whose matrix the dense head reuses (no second ``[V, H]``
    tensor). A quantization method may still serve the head, from the embedding's checkpoint
    tensor (``tied_to`` names it) but with weights of its own.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, quant_config: QuantizationConfig | None = None,
                 prefix: str = "lm_head", tied: VocabParallelEmbedding | None = None,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.prefix = num_embeddings, embedding_dim, prefix
        self.input_size = embedding_dim
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.shard = VocabShard(num_embeddings, self.tp_rank, self.tp_size)
        self.tied_to: str | None = tied.prefix if tied is not None else None
        method: LinearMethod | None = quant_config.get_linear_method(self, prefix) if quant_config else None
        self.quant_method: LinearMethod = method or UnquantizedLinearMethod()
        if method is None and tied is not None:
            self.weight = tied.weight  # the same Parameter: loaded (and listed) once, as the embedding's
        else:
            self.quant_method.create_weights(self, embedding_dim, [self.shard.rows], embedding_dim, num_embeddings,
                                             params_dtype or torch.get_default_dtype(), self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        dim = getattr(param, "output_dim", None)
        # a quantized head's tensors may hold the vocabulary along another dimension (GPTQ's
        # qweight [H / 8, V]) or packed (zero points of 8 vocabulary rows a word)
        packed = int(getattr(param, "packed_factor", 1)) if getattr(param, "packed_dim", None) == dim else 1
        if dim == 0 or (dim is not None and self.tp_size > 1):
            self.shard.load(param, loaded_weight, dim, packed)
        else:  # a per-tensor value (the same on every rank), or one rank's whole tensor
            default_weight_loader(param, loaded_weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        logits = self.quant_method.apply(self, hidden, None)  # [N, V / ranks]
        if self.tp_size == 1:
            return logits
        return all_gather_last_dim(logits)[..., :self.num_embeddings]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows={self.shard.start}:{self.shard.end}, "
                f"tied_to={self.tied_to}, method={type(self.quant_method).__name__}")
