"""Structured output: constraining generation to a JSON schema, a regex, a grammar or a choice.

The host-side driver of xgrammar, in small pieces (none of them imports xgrammar at import time):

- :mod:`.spec`: :class:`GrammarSpec`, what a constrained request carries to the engine (picklable);
- :mod:`.schema_features`: the JSON Schema keywords xgrammar would silently ignore, refused up front;
- :mod:`.grammars`: a spec as an xgrammar ``Grammar`` (the front end's syntax check and the
  compiler's input), and a choice list as EBNF;
- :mod:`.vocabulary`: the model's vocabulary described to xgrammar (``TokenizerInfo``);
- :mod:`.compiler_pool`: compilation on worker threads, off the step loop, with a bounded cache
  and a time limit;
- :mod:`.driver`: the engine's side: requests wait for their grammar, one matcher per completion,
  the step's bitmask rows, and the tokens accepted after each step.

The bitmask itself is applied by a logits processor of the sampler
(:class:`loom.sample.processors.TokenBitmask`).
"""

from .spec import GrammarSpec

__all__ = ["GrammarSpec"]
