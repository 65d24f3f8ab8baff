"""Draft-model drafts: a small model with the target's tokenizer guesses the next tokens greedily.

The draft model runs on a worker of its own (``loom.worker``: its device, weights, KV pool and
model runner), inside the engine's step loop: each ``propose`` first brings every sequence's
draft KV up to date with the tokens the target accepted (one step: the tokens the draft has not
computed yet, usually the target's last token and the accepted drafts), then decodes one draft
token per step, greedily, for as many steps as the longest request allows. Its KV is kept in
step with the target's by the token lists themselves: a sequence's draft state keeps the tokens
its KV was computed for, and a call whose verified tokens diverge from them (rejected drafts)
rolls the computed count back to the common prefix; the stale slots are overwritten.

Its steps of one or two new tokens per sequence replay CUDA graphs, and so do its catch-ups
after rejections or back-offs (up to 128 tokens a sequence): such a step is laid out at a
captured width by recomputing, in front of each sequence's new tokens, tokens whose KV the draft
holds already, without writing their KV (``draft_catch_up``; ``LOOM_DRAFT_CATCH_UP_GRAPHS=0``
runs them eagerly). The others (a sequence's first call, which computes its prompt, longer
catch-ups, sequences shorter than the width, batches past the graphs') run eagerly, and a kernel
chosen by token count (the W4A16 GEMM of a quantized draft) would compile a new variant at the
first count of each class. So the proposer warms up when it is built, before the engine reports
SERVING: a step at each count its layers ask for (``LinearMethod.warm_up_token_counts``) and the
attention's mixed steps (:meth:`warm_up`).

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

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from loom import kernel_switches
from loom.plugin_api import DraftRequest, Proposer, ProposerContext

from .draft_catch_up import CATCH_UP_GRAPH_TOKENS, CATCH_UP_WIDTHS, CatchUpGraphs, step_rows

if TYPE_CHECKING:
    from loom.worker.kernel_warmup import WarmUpCounts

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
        # The widths the graphs serve, for laying out steps (None: every step runs as it is); set
        # once the warm-up below has run its steps as they are.
        self._catch_up: CatchUpGraphs | None = None
        catch_up = self._capture_graphs(context, graphs[-1]) if graphs else None
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._seqs: dict[int, _DraftSeq] = {}
        # Before the engine reports SERVING: every step shape of serving that the graphs do not
        # serve compiles its kernels now (catch-ups no graph serves run eagerly, with any number
        # of tokens).
        self._max_len = context.max_model_len  # 0: unknown
        max_seqs = context.max_batch_size or 256
        max_tokens = self.num_blocks * _BLOCK  # a step's new tokens all have slots in the pool
        if self._max_len:
            max_tokens = min(max_tokens, max_seqs * (self._max_len + context.num_speculative_tokens + 1))
        self.warm_up(self.worker.warm_up_token_counts(max_tokens, max_seqs))
        self._catch_up = catch_up
        log.info("draft model ready", model_dir=str(info.model_dir), quantization=info.quantization,
                 kv_tokens=self.num_blocks * _BLOCK)

    def _capture_graphs(self, context: ProposerContext, max_batch: int) -> CatchUpGraphs | None:
        """Capture the draft's graphs (logged once with their time and memory): widths 1 and 2
        (a decode step; after a fully accepted run the draft first computes its last guess and
        the target's bonus token) and the catch-up widths, within ``CATCH_UP_GRAPH_TOKENS`` rows
        (the decode widths at every batch size up to ``max_batch``)."""
        import torch

        widths = (1, 2) + (CATCH_UP_WIDTHS if kernel_switches.draft_catch_up_graphs else ())
        device = self.worker.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        started = time.monotonic()
        # a draft runs k past the target's sequence at most
        self.worker.capture_cuda_graphs(context.max_model_len + context.num_speculative_tokens + 1, widths,
                                        max_graph_tokens=max(CATCH_UP_GRAPH_TOKENS, 2 * max_batch))
        runner = self.worker.runner.cuda_graphs if self.worker.runner is not None else None
        if runner is None:
            return None
        log.info("draft model cuda graphs captured", query_lens=runner.captured_query_lens,
                 graphs=len(runner.graphs), seconds=round(time.monotonic() - started, 2),
                 mib=round((free_before - torch.cuda.mem_get_info(device)[0]) / (1 << 20)),
                 catch_up_graphs=kernel_switches.draft_catch_up_graphs)
        return CatchUpGraphs(tuple(runner.captured_query_lens), runner.graph_size)

    def warm_up(self, counts: WarmUpCounts) -> None:
        """Run the draft through the step shapes of serving that no CUDA graph serves, so that
        their kernels compile before the server reports SERVING (on the H200 a second or more
        each, which W5 b's first timed run lost to catch-ups of 17, 33 and 65 tokens):

        - for each of ``counts.body``, a step of that many new tokens (one sequence, or several
          where one would pass the model's length): a catch-up, or a sequence's first call;
        - two sequences of 2 and 3 new tokens, then of 1 and 3: the attention launches of steps
          that mix query lengths, without and with a one-token row;
        - for each of ``counts.head``, a step that samples that many sequences.

        Blocks are taken from the pool and given back; a count the pool cannot hold is skipped
        (serving cannot make it either)."""
        free_before = len(self._free)
        steps: list[list[int]] = [self._split(t) for t in counts.body]
        steps += [[1] * c for c in counts.head]
        for lengths in steps:
            seqs = [_DraftSeq(tokens=_filler(n, self.vocab_size)) for n in lengths]
            if all(self._reserve(st, len(st.tokens)) for st in seqs):
                self._step(seqs)
            self._give_back(seqs)
        a, b = _DraftSeq(tokens=_filler(2, self.vocab_size)), _DraftSeq(tokens=_filler(3, self.vocab_size))
        if self._reserve(a, 3) and self._reserve(b, 6):
            self._step([a, b])  # query lengths 2 and 3
            a.tokens += _filler(1, self.vocab_size)
            b.tokens += _filler(3, self.vocab_size)
            self._step([a, b])  # 1 and 3: a decode row beside a longer one
        self._give_back([a, b])
        assert len(self._free) == free_before

    def _split(self, num_tokens: int) -> list[int]:
        """``num_tokens`` new tokens as sequences of at most the model's length."""
        cap = self._max_len or num_tokens
        return [cap] * (num_tokens // cap) + ([num_tokens % cap] if num_tokens % cap else [])

    def _give_back(self, seqs: list[_DraftSeq]) -> None:
        for st in seqs:
            self._free.extend(reversed(st.blocks))
            st.blocks = []

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
        """One forward of the draft over each sequence's uncomputed tokens; its greedy next tokens.
        Where a captured width fits (``draft_catch_up``), every sequence's rows are that many, the
        tokens before its new ones recomputed without writing their KV, so a graph serves it."""
        from loom.sample.batch import SamplingPlan
        from loom.worker.step_plan import StepPlan

        width = None
        if self._catch_up is not None:
            width = self._catch_up.width([len(st.tokens) - st.computed for st in seqs], [len(st.tokens) for st in seqs])
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for st in seqs:
            rows = step_rows(st.tokens, st.computed, width, st.blocks, _BLOCK)
            ids += rows[0]
            positions += rows[1]
            slots += rows[2]
            query_lens.append(len(rows[0]))
            seq_lens.append(len(st.tokens))
            sample_rows.append(len(ids) - 1)
            st.computed = len(st.tokens)
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


def _filler(n: int, vocab_size: int) -> list[int]:
    """``n`` valid token ids for warm-up steps (what they are does not matter)."""
    return [3 + i % max(1, vocab_size - 3) for i in range(n)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
