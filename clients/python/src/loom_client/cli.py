"""``loom-client``: call a Loom server from the command line.

    loom-client info
    loom-client generate "The capital of France is" --max-new-tokens 8
    loom-client stream --chat "Write a haiku about looms" --temperature 0.7
    loom-client generate --chat "Describe a cat" --json-schema cat.schema.json
    echo "some text" | loom-client tokenize - --offsets --json

Exit status: 0 on success, 1 when the server returns an error, 2 for bad arguments, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from . import __version__
from ._balancing import LOAD_BALANCING_POLICIES
from ._requests import ChatMessageLike
from ._security import read_pem, tls_credentials
from .client import LoomClient
from .parameters import PARAMETER_FIELDS, ParameterOptions
from .v1 import generation_pb2 as pb

DEFAULT_TARGET = "localhost:50051"

# (option name, value type, help); bool options are flags. Names match ParameterOptions.
_PARAMETER_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("max_new_tokens", int, "most tokens to generate (server default when unset)"),
    ("min_new_tokens", int, "fewest tokens to generate before EOS or stop sequences count"),
    ("do_sample", bool, "sample instead of greedy decoding"),
    ("temperature", float, "sampling temperature; 0 forces greedy decoding"),
    ("top_k", int, "sample among the k most likely tokens"),
    ("top_p", float, "nucleus sampling mass, in (0, 1]"),
    ("typical_p", float, "typical sampling mass, in (0, 1]"),
    ("min_p", float, "drop tokens below min_p times the top probability"),
    ("seed", int, "random seed of the request"),
    ("ignore_eos", bool, "keep generating past EOS tokens"),
    ("include_stop_sequence", bool, "keep the matched stop sequence in the text"),
    ("time_limit_ms", int, "stop after this many milliseconds"),
    ("repetition_penalty", float, "repetition penalty (1.0: off)"),
    ("frequency_penalty", float, "frequency penalty, in [-2, 2]"),
    ("presence_penalty", float, "presence penalty, in [-2, 2]"),
    ("tokens", bool, "report generated tokens"),
    ("logprobs", bool, "report generated tokens' logprobs"),
    ("top_n_tokens", int, "report this many alternatives per generated token"),
    ("prompt_logprobs", bool, "report the prompt's tokens and logprobs"),
    ("return_full_text", bool, "prefix the completion with the prompt"),
    ("truncate_input_tokens", int, "keep only the last N prompt tokens"),
    ("n", int, "number of completions"),
    ("best_of", int, "candidates to generate; the best n are returned"),
    ("priority", int, "scheduling priority (lower first)"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_metadata(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"metadata must be KEY=VALUE, got {item!r}")
    return key.lower(), value


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"token ids must be integers separated by commas or spaces, got {text!r}"
        ) from None


def _add_common(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Options accepted both before and after the subcommand (the later one wins)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--target",
        default=default(os.environ.get("LOOM_TARGET", DEFAULT_TARGET)),
        help=f"server address (default: $LOOM_TARGET or {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout", type=float, default=default(None), help="deadline of the call, in seconds"
    )
    parser.add_argument(
        "--tls", action="store_true", default=default(False), help="connect with TLS (system roots)"
    )
    parser.add_argument(
        "--tls-ca",
        default=default(None),
        metavar="PEM",
        help="connect with TLS, checking the server against this CA file",
    )
    parser.add_argument(
        "--tls-cert",
        default=default(None),
        metavar="PEM",
        help="client certificate for mutual TLS (with --tls-key)",
    )
    parser.add_argument("--tls-key", default=default(None), metavar="PEM", help="private key of --tls-cert")
    parser.add_argument(
        "--api-key",
        default=default(os.environ.get("LOOM_API_KEY")),
        help="send 'authorization: Bearer KEY' (default: $LOOM_API_KEY)",
    )
    parser.add_argument(
        "--load-balancing",
        choices=LOAD_BALANCING_POLICIES,
        default=default(None),
        help="gRPC policy over the addresses TARGET resolves to (dns:///host:port, ipv4:a:p,b:p)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=default(1),
        metavar="N",
        help="try a call answered UNAVAILABLE before any output up to N times in all (max 5)",
    )
    parser.add_argument(
        "--metadata",
        "-H",
        type=_parse_metadata,
        action="append",
        default=default([]),
        metavar="KEY=VALUE",
        help="call metadata (repeatable)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print the response(s) as JSON"
    )


def _add_prompt(parser: argparse.ArgumentParser, *, token_ids: bool) -> None:
    parser.add_argument("text", nargs="?", help="the prompt; '-' reads it from standard input")
    if token_ids:
        parser.add_argument(
            "--token-ids", type=_parse_token_ids, help="prompt token ids instead of text: '1,2,3'"
        )
    parser.add_argument(
        "--chat", action="store_true", help="send the text as a user message through the chat template"
    )
    parser.add_argument("--system", help="with --chat: a system message before the user's")
    parser.add_argument(
        "--no-generation-prompt",
        dest="add_generation_prompt",
        action="store_false",
        help="with --chat: do not open the assistant's turn",
    )
    parser.add_argument(
        "--no-parse-special-tokens",
        dest="parse_special_tokens",
        action="store_const",
        const=False,
        default=None,
        help="tokenize markup such as '<|im_start|>' in the text as plain characters, not special tokens",
    )


def _add_generation(parser: argparse.ArgumentParser) -> None:
    _add_prompt(parser, token_ids=True)
    parser.add_argument("--request-id", default="", help="request id (server-assigned when empty)")
    parser.add_argument("--adapter-id", default="", help="LoRA adapter to generate with (empty: the base model)")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="print finish reasons and usage to stderr"
    )
    group = parser.add_argument_group("generation parameters (server defaults when not given)")
    group.add_argument(
        "--stop", dest="stop_sequences", action="append", metavar="TEXT", help="stop sequence (repeatable)"
    )
    group.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        action="append",
        type=int,
        metavar="ID",
        help="stop token id (repeatable)",
    )
    for name, kind, help_text in _PARAMETER_FLAGS:
        flags = [_flag(name), "-n"] if name == "n" else [_flag(name)]
        if kind is bool:
            group.add_argument(
                *flags, dest=name, action="store_const", const=True, default=None, help=help_text
            )
        else:
            group.add_argument(*flags, dest=name, type=kind, default=None, help=help_text)
    group = parser.add_argument_group("structured output (at most one)")
    group.add_argument(
        "--json-schema",
        dest="json_schema_file",
        metavar="FILE",
        help="the output must validate against this JSON Schema file",
    )
    group.add_argument(
        "--json-object",
        dest="json_object",
        action="store_const",
        const=True,
        default=None,
        help="the output is a JSON object",
    )
    group.add_argument("--regex", metavar="REGEX", help="the output must match this regular expression")
    group.add_argument(
        "--grammar",
        dest="grammar_file",
        metavar="FILE",
        help="the output must match this EBNF grammar file (start rule: root)",
    )
    group.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is exactly one of these (repeatable)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom-client", description="Call a Loom gRPC server.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("generate", "generate and print the completions"),
        ("stream", "generate, printing text as it comes"),
    ):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        _add_common(sub, suppress=True)
        _add_generation(sub)
    sub = commands.add_parser(
        "tokenize", help="print the tokens of a prompt", description="print the tokens of a prompt"
    )
    _add_common(sub, suppress=True)
    _add_prompt(sub, token_ids=False)
    sub.add_argument("--offsets", action="store_true", help="report each token's character span")
    sub.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_const",
        const=False,
        default=None,
        help="do not add the tokenizer's special tokens (BOS...)",
    )
    sub = commands.add_parser(
        "info", help="describe the served model and limits", description="describe the served model"
    )
    _add_common(sub, suppress=True)
    sub = commands.add_parser(
        "adapters", help="list the LoRA adapters loaded", description="list the LoRA adapters loaded"
    )
    _add_common(sub, suppress=True)
    return parser


class UsageError(Exception):
    """Bad command-line arguments found after parsing; exit status 2."""


def _prompt(args: argparse.Namespace) -> dict[str, Any]:
    """The text/token_ids/messages keyword arguments of a client call."""
    text: str | None = args.text
    if text == "-":
        text = sys.stdin.read()
    token_ids: list[int] | None = getattr(args, "token_ids", None)
    if text is not None and token_ids is not None:
        raise UsageError("give either a text or --token-ids, not both")
    if text is None and token_ids is None:
        raise UsageError(
            "give a prompt: TEXT, '-' for standard input"
            + (", or --token-ids" if hasattr(args, "token_ids") else "")
        )
    if args.parse_special_tokens is not None and (args.chat or token_ids is not None):
        raise UsageError("--no-parse-special-tokens applies to a text prompt only (not --chat or --token-ids)")
    if not args.chat:
        if args.system is not None:
            raise UsageError("--system needs --chat")
        if token_ids is not None:
            return {"token_ids": token_ids}
        return {"text": text, "parse_special_tokens": args.parse_special_tokens}
    if text is None:
        raise UsageError("--chat needs a text prompt")
    messages: list[ChatMessageLike] = []
    if args.system is not None:
        messages.append(("system", args.system))
    messages.append(("user", text))
    return {"messages": messages, "add_generation_prompt": args.add_generation_prompt}


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror}") from exc


def _options(args: argparse.Namespace) -> ParameterOptions:
    options: dict[str, Any] = {
        name: getattr(args, name) for name in PARAMETER_FIELDS if getattr(args, name, None) is not None
    }
    if getattr(args, "json_schema_file", None) is not None:
        options["json_schema"] = _read_text(args.json_schema_file, "--json-schema")
    if getattr(args, "grammar_file", None) is not None:
        options["grammar"] = _read_text(args.grammar_file, "--grammar")
    return options  # type: ignore[return-value]  # keys are PARAMETER_FIELDS, checked again when built


def _to_json(message: Message, *, compact: bool = False) -> str:
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=not compact
    )
    return json.dumps(
        data, ensure_ascii=False, separators=(",", ":") if compact else None, indent=None if compact else 2
    )


def _finish_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()  # type: ignore[arg-type]


def _print_completions(completions: Sequence[tuple[int, str]], out: TextIO) -> None:
    if len(completions) == 1:
        out.write(completions[0][1] + "\n")
        return
    for index, text in completions:
        out.write(f"--- completion {index} ---\n{text}\n")


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    files = (args.tls_ca, args.tls_cert, args.tls_key)
    if not args.tls and all(f is None for f in files):
        return None
    try:
        root, chain, key = (None if f is None else read_pem(f) for f in files)
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    return tls_credentials(root, chain, key)


def _run_generate(client: LoomClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    reply = client.generate(request_id=args.request_id, adapter_id=args.adapter_id, **_prompt(args), **_options(args))
    if args.json:
        out.write(_to_json(reply) + "\n")
        return
    _print_completions([(c.index, c.text) for c in reply.completions], out)
    if args.verbose:
        for c in reply.completions:
            seed = f" seed={c.seed}" if c.HasField("seed") else ""
            err.write(
                f"[{c.index}] finish={_finish_name(c.finish_reason)} tokens={c.generated_tokens}{seed}\n"
            )
        u = reply.usage
        err.write(
            f"usage: prompt={u.prompt_tokens} cached={u.cached_prompt_tokens} generated={u.generated_tokens}\n"
        )


def _run_stream(client: LoomClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    live = args.n is None or args.n <= 1  # several completions interleave: print them at the end
    texts: dict[int, list[str]] = {}
    for chunk in client.stream(request_id=args.request_id, adapter_id=args.adapter_id, **_prompt(args),
                               **_options(args)):
        if args.json:
            out.write(_to_json(chunk, compact=True) + "\n")
            out.flush()
            continue
        if live:
            out.write(chunk.text)
            out.flush()
        else:
            texts.setdefault(chunk.index, []).append(chunk.text)
        if args.verbose and chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            u = chunk.usage
            err.write(
                f"\n[{chunk.index}] finish={_finish_name(chunk.finish_reason)} prompt={u.prompt_tokens} "
                f"cached={u.cached_prompt_tokens} generated={u.generated_tokens}\n"
            )
    if args.json:
        return
    if live:
        out.write("\n")
    else:
        _print_completions([(i, "".join(parts)) for i, parts in sorted(texts.items())], out)


def _run_tokenize(client: LoomClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    prompt = _prompt(args)
    reply = client.tokenize(
        prompt.get("text"),
        messages=prompt.get("messages"),
        add_generation_prompt=prompt.get("add_generation_prompt", True),
        add_special_tokens=args.add_special_tokens,
        parse_special_tokens=prompt.get("parse_special_tokens"),
        return_offsets=args.offsets,
    )
    if args.json:
        out.write(_to_json(reply) + "\n")
        return
    for token in reply.tokens:
        span = f"\t{token.offset.start}:{token.offset.end}" if token.HasField("offset") else ""
        out.write(f"{token.id}\t{token.text!r}{span}\n")
    out.write(f"{reply.token_count} tokens\n")


def _run_info(client: LoomClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    info = client.model_info()
    if args.json:
        out.write(_to_json(info) + "\n")
        return
    lines = [
        f"model_id: {info.model_id}",
        f"architecture: {info.architecture}",
        f"dtype: {info.dtype}",
        f"device: {info.device}",
        f"server_version: {info.server_version}",
        f"vocab_size: {info.vocab_size}",
        f"eos_token_ids: {', '.join(str(i) for i in info.eos_token_ids)}",
        f"block_size: {info.block_size}",
        f"num_shard: {info.num_shard}",
        f"has_chat_template: {str(info.has_chat_template).lower()}",
        "limits:",
        *(f"  {field.name}: {value}" for field, value in _all_fields(info.limits)),
        "plugins:",
        *(f"  {p.kind}: {p.name} ({p.distribution} {p.version})" for p in info.plugins),
    ]
    out.write("\n".join(lines) + "\n")


def _all_fields(message: Message) -> list[tuple[Any, Any]]:
    return [(field, getattr(message, field.name)) for field in message.DESCRIPTOR.fields]


def _run_adapters(client: LoomClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    listed = client.list_adapters()
    if args.json:
        out.write(_to_json(listed) + "\n")
        return
    out.write(f"max_loras: {listed.max_loras}, max_lora_rank: {listed.max_lora_rank}\n")
    for a in listed.adapters:
        out.write(f"{a.adapter_id}\trank {a.rank}\talpha {a.alpha:g}\t{','.join(a.target_modules)}\t{a.path}\n")


_COMMANDS: dict[str, Callable[[LoomClient, argparse.Namespace, TextIO, TextIO], None]] = {
    "generate": _run_generate,
    "stream": _run_stream,
    "tokenize": _run_tokenize,
    "info": _run_info,
    "adapters": _run_adapters,
}


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with LoomClient(
            args.target,
            timeout=args.timeout,
            metadata=args.metadata,
            credentials=_credentials(args),
            api_key=args.api_key or None,
            load_balancing=args.load_balancing,
            max_attempts=args.max_attempts,
        ) as client:
            _COMMANDS[args.command](client, args, out, err)
    except (UsageError, ValueError, TypeError) as exc:
        err.write(f"loom-client {args.command}: error: {exc}\n")
        return 2
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        err.write(f"loom-client {args.command}: {code.name if code is not None else 'error'}: {details}\n")
        return 1
    except KeyboardInterrupt:
        err.write("\ninterrupted\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
