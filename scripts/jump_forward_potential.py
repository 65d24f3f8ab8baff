"""How many decode steps grammar jump-forward drafts could save on S1 (#17), on the CPU.

Jump-forward: where a grammar forces the next characters (a JSON key after ``, "``, the ``": `` after
it), those tokens can be verified as drafts instead of decoded one a step. This script generates
S1's eight schemas once each with SmolLM2 (greedy, constrained, 128 new tokens at most), then
replays each output through a fresh matcher: at every step the drafts are xgrammar's
``find_jump_forward_tokens()`` (up to ``k``), accepted while they equal the model's own tokens (as
a verification would), plus the model's token. It prints tokens per step and the drafts' acceptance.

    python3 scripts/jump_forward_potential.py [--k 2,4,8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from loom.bench.structured import SCHEMAS, request_prompt
from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.frontend.tokenizer import Tokenizer
from loom.model_loader import resolve_model_dir
from loom.structured.grammars import to_grammar
from loom.structured.spec import GrammarSpec
from loom.structured.vocabulary import vocabulary_from_model_dir


def _spec(name: str) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(SCHEMAS[name]), "parameters.constraint.json_schema")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", default="2,4,8", help="the most drafts a step")
    args = parser.parse_args()
    import xgrammar as xg

    cfg = EngineConfig(device="cpu", max_total_tokens=512, max_batch_prefill_tokens=4096)
    engine = LLMEngine(cfg)
    model_dir = resolve_model_dir(cfg.model_id)
    tokenizer = Tokenizer.from_model_dir(Path(model_dir))
    names = list(SCHEMAS)
    for i, name in enumerate(names):
        prompt = tokenizer.encode_chat([{"role": "system", "content": "Answer with JSON only."},
                                        {"role": "user", "content": request_prompt(name, i, False)}])
        engine.add_request(EngineRequest(name, tuple(prompt), SamplingParams(constraint=_spec(name)),
                                         StoppingParams(max_new_tokens=128)))
    outputs: dict[str, list[int]] = {name: [] for name in names}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += list(out.token_ids)
    eos = list(engine.eos_token_ids)
    compiler = xg.GrammarCompiler(vocabulary_from_model_dir(model_dir, engine.vocab_size, eos))
    for k in (int(v) for v in args.k.split(",")):
        tokens = steps = proposed = accepted = 0
        longest = (0, 0)  # (tokens, steps) of the longest output: a batch steps as long as it
        for name in names:
            toks = outputs[name]
            matcher = xg.GrammarMatcher(compiler.compile_grammar(to_grammar(_spec(name))), override_stop_tokens=eos)
            pos = n = 0
            while pos < len(toks):
                drafts = matcher.find_jump_forward_tokens()[:k]
                ok = 0
                while ok < len(drafts) and pos + ok < len(toks) and drafts[ok] == toks[pos + ok]:
                    ok += 1
                proposed, accepted = proposed + len(drafts), accepted + ok
                for t in toks[pos:pos + ok + 1]:
                    if t not in eos:
                        matcher.accept_token(t)
                pos, n = pos + ok + 1, n + 1
            tokens, steps = tokens + len(toks), steps + n
            longest = max(longest, (len(toks), n))
        print(json.dumps({"k": k, "tokens": tokens, "steps": steps, "tokens_per_step": round(tokens / steps, 3),
                          "drafts": proposed, "accepted": accepted,
                          "acceptance": round(accepted / max(1, proposed), 3),
                          "longest_output_tokens_steps": longest}))


if __name__ == "__main__":
    main()
