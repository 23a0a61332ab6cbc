"""Corpus sweep: every architecture transformers builds from a tiny default config, plus hand-written styles,
each predicted by tracer (--target cpu, eager policy, dropout 0) and measured in a real CPU step.

    python benchmarks/wild.py [--only NAME,...] [--limit N] [--json PATH] [--time-limit S] [--capture auto|graph|dispatch]

Names: `hf:<model_type>` for transformers (every model_type of CONFIG_MAPPING with a causal-lm, masked-lm,
seq2seq, image-classification, speech-seq2seq or CTC head, its default head as `hf:` picks it) and
`style:<file>` for the model files in benchmarks/wild_styles/. Each transformers config is shrunk by generic
overrides applied only where the default config has the key (`tiny_overrides`: layers 2, width 64, 4 heads,
vocab 256, image 32, patch 8, dropouts 0, per-layer lists and dicts keyed by layer index cut to the new
depth, sizes that sum to a shrunk width rescaled to the new one, a grid of positions made to fill SEQ, ...),
also inside nested sub-configs; where the real model does not
run with that config (transformers raises on real tensors: the shrinking broke a constraint between keys),
gentler shrinks are tried (`SHRINKS`), and the row names the one used.

One row per model: built (the real model builds), traced (the capture rung), peak / phase peaks / saved bytes
predicted vs measured (tests/truth.py's `measure_step`, AdamW at torch's CPU default, steady step), seconds. A model is
`exact` when every phase peak is within 0.1% and saved bytes are equal, `off` otherwise; `fail` names the
stage (build, trace, measure) and the error's first line; mixtures of experts are compared with their
transformers routers made to route as the `balanced` assumption (truth.balanced_routers), any other router
at its topk / argmax calls (truth.BalancedTopk). Each model runs in its own
try/except under a wall-clock limit (SIGALRM), so the sweep never stops early.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
STYLES = os.path.join(ROOT, "benchmarks", "wild_styles")

import torch  # noqa: E402

from tracer.capture.build import StepModule  # noqa: E402
from tracer.capture.caller_held import outputs_besides  # noqa: E402
from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source  # noqa: E402
from tracer.passes.analysis import analyze_graphs  # noqa: E402
from truth import BalancedTopk, balanced_routers, is_topk_router, measure_step  # noqa: E402

BATCH, SEQ = 2, 16
PHASES = ("forward", "backward", "optimizer")
SWEPT_TASKS = ("seq2seq", "speech-seq2seq", "masked-lm", "causal-lm", "image-classification", "ctc")

# generic tiny sizes (value: the keys it is set on), set only where a config already has the key
TINY = (
    (2, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
         "num_decoder_layers", "num_encoder_layers", "num_key_value_heads", "num_kv_heads",
         "multi_query_group_num", "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")),
    (64, ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim", "embedding_size",
          "projection_dim", "d_embed", "emb_dim", "entity_emb_size")),
    (4, ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
         "decoder_attention_heads", "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")),
    (16, ("head_dim", "d_kv", "kv_channels", "num_mel_bins", "qk_rope_head_dim", "v_head_dim", "rotary_dim")),
    (128, ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim", "n_inner",
           "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "decoder_hidden_size",
           "expert_ffn_hidden_size")),
    (256, ("vocab_size",)),
    (32, ("image_size", "max_source_positions", "qk_nope_head_dim")),
    (8, ("patch_size",)),
    (1, ("n_group", "num_expert_group", "topk_group")),     # expert groups must not outnumber the shrunk experts
)
TINY_BY_KEY = {key: value for value, keys in TINY for key in keys}
TINY_VOCABULARY = 256                 # also every other integer key naming a vocabulary (entity, hash, per-layer)
# float scalings of depth (compound-scaled CNNs) set to 1 where larger: depth, like the layer counts
UNSCALED = ("depth_coefficient", "depth_multiplier")
LAYER_KEYS = TINY[0][1][:8]


# key groups a gentler shrink leaves at their defaults: the attention geometry (head sizes, key/value heads,
# multi-latent attention's split dims), which several architectures constrain together
HEAD_GEOMETRY = frozenset(("head_dim", "d_kv", "kv_channels", "qk_rope_head_dim", "v_head_dim", "rotary_dim",
                           "qk_nope_head_dim", "num_key_value_heads", "num_kv_heads", "multi_query_group_num",
                           "num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
                           "decoder_attention_heads"))
# the shrinks tried in order: the first whose real model runs a forward and backward is used
MAX_PARAMETERS = 30_000_000           # a real CPU step of a larger shrink is too slow for the sweep
TINY_SHRINK = "tiny"
PROPORTIONAL = "tiny, in the default's proportions"
DEFAULT_HEADS = "tiny, default heads"
DEFAULT_LISTS = "tiny, default heads and per-layer lists"
DEPTH_ONLY = "layers and vocabulary only"
SHRINKS = (TINY_SHRINK, PROPORTIONAL, DEFAULT_HEADS, DEFAULT_LISTS, DEPTH_ONLY)
# what the last shrink still shrinks: depth, vocabulary and expert counts (dropouts are always 0)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
DEPTH_AND_VOCABULARY = frozenset(LAYER_KEYS) | {"vocab_size", *EXPERT_COUNTS, *TOP_K_KEYS}
# key/value head counts and the attention head counts they must equal when the default config has them equal
# (multi-latent attention expands its latent to one key and value per query head: DeepSeek V2/V3, MiniCPM3)
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
ATTENTION_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def tiny_overrides(config: dict, shrink: str = "tiny") -> dict:
    """Generic shrinking of one config dict (and of its nested sub-configs): keys of TINY where present and
    larger, dropouts 0, list-valued per-stage sizes shortened, per-layer lists cut to the new layer count,
    token ids kept inside the shrunk vocabulary. The gentler `SHRINKS` keep the total head width in the
    default's proportion to the hidden size and counts of some layers in proportion to the depth, then keep the attention geometry (HEAD_GEOMETRY), then also the
    per-layer lists at their defaults, then every width (only depth, vocabulary and expert counts shrink)."""
    out = {}
    keep = HEAD_GEOMETRY if shrink in (DEFAULT_HEADS, DEFAULT_LISTS) else frozenset()
    if shrink == DEPTH_ONLY:
        keep = frozenset(TINY_BY_KEY) - DEPTH_AND_VOCABULARY
    layers_before = next((config[k] for k in LAYER_KEYS if isinstance(config.get(k), int)), None)
    if isinstance(config.get("depths"), list) and layers_before == len(config["depths"]):
        layers_before = None   # a stage count (hierarchical vision models): per-stage lists keep their length
        keep = keep | {k for k in LAYER_KEYS if config.get(k) == len(config["depths"])}
    for key, value in config.items():
        if key in keep:
            continue
        if isinstance(value, dict) and "model_type" in value:
            out[key] = {**value, **tiny_overrides(value, shrink)}
        elif key in TINY_BY_KEY and isinstance(value, int) and not isinstance(value, bool) and value > TINY_BY_KEY[key]:
            out[key] = TINY_BY_KEY[key]
        elif ("vocab" in key and not key.endswith("_id") and isinstance(value, int) and not isinstance(value, bool)
              and value > TINY_VOCABULARY and key not in keep):
            out[key] = TINY_VOCABULARY
        elif key in UNSCALED and isinstance(value, float) and value > 1.0:
            out[key] = 1.0
        elif isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "drop_path", "drop_rate", "drop_connect", "layerdrop")):
            out[key] = 0.0
        elif key == "depths" and isinstance(value, list) and shrink != DEPTH_ONLY:
            out[key] = [1] * len(value)
        elif key in ("hidden_sizes", "embed_dims", "embedding_dims") and isinstance(value, list) \
                and shrink != DEPTH_ONLY:
            out[key] = [32 * (i + 1) for i in range(len(value))]     # group norms take up to 32 groups
        elif key in ("num_heads", "num_attention_heads") and isinstance(value, list):
            out[key] = [2] * len(value)
        elif (isinstance(value, list) and layers_before and len(value) == layers_before
              and key not in ("depths", "hidden_sizes") and shrink != DEFAULT_LISTS):
            out[key] = value[:2]
        elif _keyed_by_layer(value) and shrink != DEFAULT_LISTS:
            out[key] = {k: v for k, v in value.items() if int(k) < TINY_BY_KEY["num_hidden_layers"]}
    _keep_kv_heads_equal(config, out)
    _keep_parts_summing_to_width(config, out)
    _keep_position_grid_filled(config, out)
    _route_to_top_k(config, out)
    if shrink == PROPORTIONAL:
        _keep_head_width_proportional(config, out)
        _keep_layer_counts_proportional(config, out, layers_before)
    if shrink == DEFAULT_LISTS:
        for key in LAYER_KEYS:
            out.pop(key, None)             # per-layer lists at their defaults need the default layer count
    vocab = out.get("vocab_size", config.get("vocab_size"))
    if isinstance(vocab, int):
        for key, value in config.items():
            if key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
                out[key] = value % vocab
    return out


def _keyed_by_layer(value) -> bool:
    """A dict of per-layer settings keyed by layer index (`{"05": {"head_dim": 512}, ...}`)."""
    return (isinstance(value, dict) and bool(value) and "model_type" not in value
            and all(isinstance(k, (int, str)) and str(k).isdigit() for k in value))


def _keep_head_width_proportional(config: dict, out: dict) -> None:
    """heads x head_dim keeps its default ratio to the hidden size where that ratio makes a whole head width
    (a state-space mixer whose heads span hidden_size * expand: 128 x 64 = 2 x 4096 -> 4 x 32 = 2 x 64)."""
    heads_key = next((k for k in ATTENTION_HEADS if isinstance(config.get(k), int)), None)
    width_key = next((k for k in TINY[1][1] if isinstance(config.get(k), int)), None)
    if heads_key is None or width_key is None or not isinstance(config.get("head_dim"), int):
        return
    total, width = config[heads_key] * config["head_dim"], config[width_key]
    heads, tiny_width = out.get(heads_key, config[heads_key]), out.get(width_key, width)
    head_dim, rest = divmod(total * tiny_width, width * heads)
    if rest == 0 and head_dim > 0:
        out["head_dim"] = head_dim
    for key, groups in config.items():          # head groups (B/C shared by a group of heads) still divide them
        if key.endswith("_groups") and isinstance(groups, int) and not isinstance(groups, bool) and groups > 0 \
                and config[heads_key] % groups == 0 and heads % groups:
            out[key] = math.gcd(groups, heads)


def _int_list(value) -> bool:
    return (isinstance(value, list) and len(value) > 1
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))


def _keep_parts_summing_to_width(config: dict, out: dict) -> None:
    """A list of sizes summing to a width the shrink changes (parts concatenated into it: Reformer's axial
    position embeddings, 64 + 192 = 256) is rescaled in proportion to sum to the new width."""
    from tracer.models.hf import split_width
    widths = {config[k]: out[k] for k in TINY[1][1] if k in out and isinstance(config.get(k), int)}
    for key, value in config.items():
        if key not in out and _int_list(value) and sum(value) in widths:
            out[key] = split_width(value, widths[sum(value)])


def _keep_position_grid_filled(config: dict, out: dict) -> None:
    """A list of sizes multiplying to max_position_embeddings (positions laid out on a grid, as axial position
    embeddings do) is made to multiply to SEQ: such a model trains only on sequences that fill its grid."""
    from tracer.models.hf import axial_grid
    positions = config.get("max_position_embeddings")
    for key, value in config.items():
        if key not in out and _int_list(value) and all(v > 1 for v in value) and math.prod(value) == positions:
            out[key] = axial_grid(SEQ, len(value))


def _route_to_top_k(config: dict, out: dict) -> None:
    """A top-k left unset (None) beside more than one routed expert gets the tiny top-k: the router picks
    that many experts per token (a default config that leaves it to the checkpoint does not run at all)."""
    if any(isinstance(config.get(k), int) and config[k] > 1 for k in EXPERT_COUNTS):
        for key in TOP_K_KEYS:
            if key in config and config[key] is None:
                out[key] = TINY_BY_KEY[key]


def _keep_layer_counts_proportional(config: dict, out: dict, layers_before: int | None) -> None:
    """Counts of some of the layers (`num_kv_shared_layers`: the last 15 of 35 reuse earlier layers' keys and
    values) keep their share of the new depth: at least one layer, and fewer than all where they were fewer."""
    layers = next((out[k] for k in LAYER_KEYS if isinstance(out.get(k), int)), None)
    if not layers_before or not layers:
        return
    for key, count in config.items():
        if key.endswith("_layers") and key not in LAYER_KEYS and isinstance(count, int) \
                and not isinstance(count, bool) and 0 < count < layers_before:
            out[key] = min(max(1, round(count * layers / layers_before)), layers - 1)


def _keep_kv_heads_equal(config: dict, out: dict) -> None:
    """A key/value head count equal to the attention head count in the default config stays equal to it
    (shrinking both independently gives 2 key/value heads for 4 query heads, which such models reject)."""
    heads_key = next((k for k in ATTENTION_HEADS if isinstance(config.get(k), int)), None)
    if heads_key is None:
        return
    for key in KV_HEADS:
        if config.get(key) == config[heads_key] and key in out:
            out[key] = out.get(heads_key, config[heads_key])


def hf_names() -> list[str]:
    from tracer.models.hf import _heads, _model_types
    return [f"hf:{t}" for t in _model_types() if any(task in _heads(t) for task in SWEPT_TASKS)]


def style_names() -> list[str]:
    return [f"style:{f[:-3]}" for f in sorted(os.listdir(STYLES)) if f.endswith(".py")]


class DefaultConfigBroken(Exception):
    """transformers cannot build the architecture from its own default config: not a model the sweep tries."""
    status = "skipped (default config)"
    why = "transformers' default config does not build"


def source_for(name: str, shrink: str | None = "tiny"):
    """The model source of `name`, its config shrunk by `shrink` (None: transformers' default config)."""
    if name.startswith("style:"):
        return load_model_source(os.path.join(STYLES, name[6:] + ".py"))
    overrides = shrink_overrides(name, shrink) if shrink is not None else {}
    return load_model_source(name, hf_config=tuple(f"{k}={json.dumps(v)}" for k, v in overrides.items()))


def shrink_overrides(name: str, shrink: str) -> dict:
    """The config overrides `shrink` makes for the transformers architecture `name` (`hf:<model_type>`)."""
    from transformers import AutoConfig
    from tracer.models.hf import hf_spec
    return tiny_overrides(AutoConfig.for_model(hf_spec(name[3:]).model_type).to_dict(), shrink)


def runnable_source(name: str):
    """(source, shrink): the first of SHRINKS whose real model builds and runs one real forward and backward
    on its example batch. A config the shrinking broke fails in transformers' own code on real tensors too;
    a config the real model runs is then traced, so a failure to trace is tracer's. Raises the first
    shrink's error when none runs."""
    errors = []
    shrinks = SHRINKS if name.startswith("hf:") else SHRINKS[:1]
    if name.startswith("hf:"):
        try:
            with torch.device("meta"):
                source_for(name, None).build_model()
        except Exception as exc:
            raise DefaultConfigBroken(_one_line(exc)) from exc
    tried = []
    for shrink in shrinks:
        if name.startswith("hf:"):
            overrides = shrink_overrides(name, shrink)
            if overrides in tried:
                continue                   # the same config as a shrink that did not run
            tried.append(overrides)
        try:
            source = source_for(name, shrink)
            with torch.device("meta"):
                parameters = sum(p.numel() for p in source.build_model().parameters())
            if parameters > MAX_PARAMETERS:
                raise ValueError(f"the {shrink} config has {parameters:,} parameters (over {MAX_PARAMETERS:,})")
            torch.manual_seed(0)
            model = source.build_model()
            StepModule(model, loss_fn=source.loss_fn, loss_index=source.loss_index)(
                *source.example_batch(BATCH, SEQ)).backward()
            return source, shrink
        except TimeLimit:
            raise
        except Exception as exc:           # the sweep tries the next shrink and reports the first one's error
            errors.append(exc)
    raise errors[0]


class TimeLimit(Exception):
    pass


def _alarm(signum, frame):
    raise TimeLimit("time limit")


@dataclasses.dataclass
class Row:
    name: str
    built: bool = False
    traced: str = ""                       # the capture rung
    status: str = "fail"                   # exact | off | fail | skipped (default config)
    reason: str = ""
    predicted: dict = dataclasses.field(default_factory=dict)    # peak, forward, backward, optimizer, saved
    measured: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    shrink: str = ""                       # the SHRINKS entry the config was built with


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:220]


def run_one(name: str, time_limit_s: int, runnable=None, capture: str = "auto") -> Row:
    """One row: `runnable(name)` gives (source, shrink) whose real model runs (default runnable_source), then
    the prediction (on the capture path `capture`) and the real step are compared. Sibling sweeps
    (wild_vision.py) pass their own."""
    row, stage = Row(name), "build"
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(time_limit_s)
    try:
        source, row.shrink = (runnable or runnable_source)(name)
        torch.manual_seed(0)
        model = source.build_model()
        routers = [m for m in model.modules() if is_topk_router(m)]
        if routers:
            model = balanced_routers(model)
            built_model = model
            plain = source
            source = dataclasses.replace(plain, build_model=lambda: balanced_routers(plain.build_model()))
        else:
            built_model = model
        row.built = True
        stage = "trace"
        graphs = capture_steps(source, CaptureOptions(batch=BATCH, seq=SEQ, target="cpu", moe_routing="balanced",
                                                      capture="auto" if capture == "graph" else capture,
                                                      op_by_op_first=capture == "auto"), (PolicySpec(name="eager"),))
        graph = graphs["eager"]
        row.traced = graph.config.capture_path
        predicted = analyze_graphs(graphs).policies["eager"]
        row.predicted = {"peak": predicted.peak_bytes, "saved": predicted.saved.total_bytes,
                         **{p: predicted.phases[p].peak_bytes for p in PHASES}}
        routed = any("routing assumed" in note for note in graph.config.notes)
        # no router module to fix: the real step's top-k / argmax calls choose as the assumption does
        choosing = BalancedTopk() if routed and not routers else contextlib.nullcontext()
        stage = "measure"
        torch.manual_seed(1)
        batch = source.example_batch(BATCH, SEQ)
        # the loss as tracer takes it (a tuple's 0-dim loss, a mapping's "loss"), and the loop as tracer
        # assumes it: a returned tuple's other outputs stay bound until the next forward returns
        # (a loss_fn takes the outputs whole: the step keeps none of them, as tracer's default loop assumes)
        keep = (source.keep if source.keep is not None
                else outputs_besides(None, source.loss_index) if source.loss_fn is None else None)
        step = StepModule(built_model, loss_fn=source.loss_fn, loss_index=source.loss_index, keep=keep)
        optimizer = torch.optim.AdamW(built_model.parameters(), lr=1e-3)    # torch's default on CPU
        with choosing:
            measured = measure_step(step, batch, optimizer, loop_held=lambda: [t for _, t in step.kept])
        row.measured = {"peak": measured.peak_bytes, "saved": measured.saved_bytes,
                        **{p: measured.phase_peaks.get(p, 0) for p in PHASES}}
        close = all(abs(row.predicted[p] - row.measured[p]) <= 1e-3 * row.measured[p] for p in PHASES)
        row.status = "exact" if close and row.predicted["saved"] == row.measured["saved"] else "off"
        if row.status == "off":
            row.reason = ", ".join(f"{k} {row.predicted[k] - row.measured[k]:+,}" for k in ("saved",) + PHASES
                                   if row.predicted[k] != row.measured[k])
    except DefaultConfigBroken as exc:
        row.status, row.reason = exc.status, str(exc)
    except (Exception, TimeLimit) as exc:          # the sweep reports every failure and goes on
        row.status, row.reason = "fail", f"{stage}: {_one_line(exc)}"
    finally:
        signal.alarm(0)
        row.seconds = time.perf_counter() - start
        gc.collect()
    return row


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:,.0f}"


def render_row(row: Row) -> str:
    def pair(key):
        p, m = row.predicted.get(key), row.measured.get(key)
        return f"{_kib(p)}/{_kib(m)}" if p is not None or m is not None else "-"
    return (f"{row.name:<34} {'yes' if row.built else 'no':<5} {row.traced or '-':<14} {pair('peak'):>17} "
            f"{pair('forward'):>17} {pair('backward'):>17} {pair('optimizer'):>17} {pair('saved'):>17} "
            f"{row.seconds:6.1f}  {row.status}{'' if row.shrink in ('', 'tiny') else f' ({row.shrink})'}")


HEADER = (f"{'model':<34} {'built':<5} {'traced':<14} {'peak KiB p/m':>17} {'forward':>17} {'backward':>17} "
          f"{'optimizer':>17} {'saved':>17} {'sec':>6}  status")


def summary(rows: list[Row], skips=(DefaultConfigBroken,)) -> str:
    """The summary line; `skips` are the skip exceptions whose rows are not counted as tried."""
    counts = {s: sum(r.status == s for r in rows) for s in ("exact", "off", "fail")}
    skipped = [(sum(r.status == skip.status for r in rows), skip.why) for skip in skips]
    tried = len(rows) - sum(n for n, _ in skipped)
    return (f"{tried} models tried: {counts['exact']} exact ({100 * counts['exact'] / max(tried, 1):.0f}%), "
            f"{counts['off']} off, {counts['fail']} fail; "
            + "; ".join(f"{n} skipped ({why})" for n, why in skipped))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names (hf:<model_type> or style:<file>)")
    parser.add_argument("--limit", type=int, help="the first N names only")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--time-limit", type=int, default=120, help="seconds per model (default 120)")
    parser.add_argument("--capture", default="auto", choices=("auto", "graph", "dispatch"),
                        help="the capture path predicted with (auto: the default command's, op by op where that "
                             "run stands for the graph; graph: the joint graph's ladder; dispatch: op by op)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.only:
        names = [n if ":" in n else f"hf:{n}" for n in args.only.split(",") if n]
    else:
        names = style_names() + hf_names()
    if args.limit:
        names = names[:args.limit]
    sweep(names, args.time_limit, args.json, capture=args.capture)
    return 0


def sweep(names: list[str], time_limit_s: int, json_path: str | None, runnable=None,
          skips=(DefaultConfigBroken,), capture: str = "auto") -> list[Row]:
    """Runs `run_one` on each name, printing each row as it comes (and rewriting `json_path`), then the
    summary line and every row that is not exact."""
    rows = []
    print(HEADER, flush=True)
    for name in names:
        row = run_one(name, time_limit_s, runnable, capture)
        rows.append(row)
        print(render_row(row), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    print()
    print(summary(rows, skips))
    for row in rows:
        if row.status != "exact":
            print(f"  {row.name}: {row.status}: {row.reason}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
