"""Draft-model drafts: a small model with the target's tokenizer guesses the next tokens greedily.

The draft model runs on a worker of its own (``loom.worker``: its device, weights, KV pool and
model runner), inside the engine's step loop: each ``propose`` first brings every sequence's
draft KV up to date with the tokens the target accepted (one step: the tokens the draft has not
computed yet, usually the target's last token and the accepted drafts), then decodes one draft
token per step, greedily, for as many steps as the longest request allows. Its KV is kept in
step with the target's by the token lists themselves: a sequence's draft state keeps the tokens
its KV was computed for, and a call whose verified tokens diverge from them (rejected drafts)
rolls the computed count back to the common prefix; the stale slots are overwritten.

Greedy drafts are a one-hot proposal, so ``loom.sample.verify``'s acceptance rule is exact rejection
sampling and the output is the target's own, token for token.

Options (``--speculator-option KEY=VALUE``): ``model_id`` (required: a directory, a .gguf file or
random:NAME, as ``--model-id``), ``quantize`` (its ``--quantize``, default auto: e.g. a GPTQ
checkpoint made by ``loom quantize``), ``kv_tokens`` (its KV pool in tokens, default 65536 on
CUDA, 8192 on the CPU). The draft's weights and pool come out of the memory the target's pool
leaves (``--cuda-memory-fraction``).

Unlike a third-party proposer, this built-in one imports Loom's worker: it reuses the very runner
the target runs on, through the same picklable step plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from loom.plugin_api import DraftRequest, Proposer, ProposerContext

log = structlog.get_logger(__name__)

_OPTIONS = {"model_id", "quantize", "kv_tokens"}
_BLOCK = 16


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # what the draft's KV was computed for (and its last guess)
    computed: int = 0  # tokens[:computed] have KV in the draft's pool
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    name = "draft"

    @classmethod
    def check_options(cls, options: dict[str, str]) -> None:
        unknown = set(options) - _OPTIONS
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; draft takes {', '.join(sorted(_OPTIONS))}")
        if not options.get("model_id"):
            raise ValueError("needs --speculator-option model_id=DIR (the draft model)")
        if "kv_tokens" in options and not options["kv_tokens"].isdigit():
            raise ValueError(f"kv_tokens must be a positive integer, got {options['kv_tokens']!r}")

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        from loom.config import EngineConfig
        from loom.plugin_api import default_registry
        from loom.worker.worker import Worker

        opts = context.options
        cpu = context.device == "cpu"
        # On CUDA its decode steps (every draft step after the first) replay graphs, as the
        # target's do: eagerly, a draft's hundreds of kernel launches would cost more than its math.
        graphs = _graph_sizes(context.max_batch_size) if not cpu and context.max_model_len else ()
        config = EngineConfig(model_id=opts["model_id"], device=context.device, dtype=context.dtype,
                              quantize=opts.get("quantize", "auto"), block_size=_BLOCK, cuda_graphs=graphs,
                              warmup=False)
        self.worker = Worker(config, default_registry())
        info = self.worker.info
        if info.vocab_size > context.vocab_size + 1024 or info.vocab_size < context.vocab_size - 1024:
            raise ValueError(f"the draft model's vocabulary ({info.vocab_size} tokens) is not the target's "
                             f"({context.vocab_size}): drafts need the same tokenizer")
        self.vocab_size = info.vocab_size
        tokens = int(opts.get("kv_tokens", 8192 if cpu else 65536))
        self.num_blocks = max(2, tokens // _BLOCK)
        self.worker.init_kv_cache(self.num_blocks)
        if graphs:  # a draft runs k past the target's sequence at most
            # (width 2 too: after a fully accepted run the draft first computes its last guess and
            # the target's bonus token)
            self.worker.capture_cuda_graphs(context.max_model_len + context.num_speculative_tokens + 1, (1, 2))
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._seqs: dict[int, _DraftSeq] = {}
        log.info("draft model ready", model_dir=str(info.model_dir), quantization=info.quantization,
                 kv_tokens=self.num_blocks * _BLOCK)

    # -- proposing ---------------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[int] = []  # indices of requests drafting this call
        for i, r in enumerate(requests):
            st = self._seqs.setdefault(r.seq_id, _DraftSeq())
            st.computed = min(st.computed, _common_prefix(st.tokens, r.token_ids), len(r.token_ids) - 1)
            st.tokens = list(r.token_ids)
            if r.max_drafts > 0 and self._reserve(st, len(st.tokens) + r.max_drafts):
                active.append(i)
        # Step 1 computes what the draft has not seen yet and guesses the first token; each later
        # step feeds the previous guess and guesses the next.
        while active:
            chosen = self._step([self._seqs[requests[i].seq_id] for i in active])
            still = []
            for i, token in zip(active, chosen, strict=True):
                st = self._seqs[requests[i].seq_id]
                st.tokens.append(token)
                drafts[i].append(token)
                if len(drafts[i]) < requests[i].max_drafts:
                    still.append(i)
            active = still
        return drafts

    def _step(self, seqs: list[_DraftSeq]) -> list[int]:
        """One forward of the draft over each sequence's uncomputed tokens; its greedy next tokens."""
        from loom.sample.batch import SamplingPlan
        from loom.worker.step_plan import StepPlan

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for st in seqs:
            start, end = st.computed, len(st.tokens)
            ids += st.tokens[start:end]
            positions += range(start, end)
            slots += [st.blocks[p // _BLOCK] * _BLOCK + p % _BLOCK for p in range(start, end)]
            query_lens.append(end - start)
            seq_lens.append(end)
            sample_rows.append(len(ids) - 1)
            st.computed = end
        n = len(seqs)
        greedy = SamplingPlan.greedy(n, self.vocab_size)
        plan = StepPlan(input_ids=ids, positions=positions, slot_mapping=slots, query_lens=query_lens,
                        seq_lens=seq_lens, block_tables=[st.blocks for st in seqs], pending_rows=[], pending_src=[],
                        sample_rows=sample_rows, sample_seq_ids=list(range(n)), sample_request_ids=[""] * n,
                        sampling=greedy)
        out = self.worker.finish(self.worker.execute(plan))
        return [t[0] for t in out.token_ids]

    def _reserve(self, st: _DraftSeq, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions; False (no drafts this time) when the pool is full."""
        need = -(-num_tokens // _BLOCK) - len(st.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            st.blocks.append(self._free.pop())
        return True

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self._free.extend(reversed(st.blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)


def _graph_sizes(max_batch: int) -> tuple[int, ...]:
    """Decode graph sizes up to the first that holds ``max_batch`` sequences (1, 2, 4, ...)."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
