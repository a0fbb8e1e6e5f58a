"""A cheap draft derived from a bigger draft model: a few of its decoder layers and a restricted LM head.

On a 2-core CPU depth is what a draft token costs, and the 151,936-row LM head of Qwen2.5 is 136M of the
0.5B's 494M parameters. A derived draft keeps the base's embedding (every token must be readable), the
decoder layers listed in `layers` (e.g. the first two and the last two), the final norm, and an LM head
over N target tokens: the rows of the base's head for the tokens the data uses most, plus every special
token (EOS included). The map draft id -> target id rides on the config (models/vocab_map.py) and is what
DraftSnapshot.vocab_ids carries, so verification stays lossless: the draft only ever proposes in-map tokens.

Default shape, by measurement (`osd draft cost`, BENCHMARKS.md): the issue's budget is c <= 0.1 (a draft token at
most a tenth of a target token on llama.cpp). With the int8 serving copy each kept 0.5B layer costs ~1.6-2 ms per
token on one core of this CPU (it reads ~15 MB), the target ~51 ms: 2 layers + 16,384 rows gave c = 0.098, 4 layers
0.16-0.17, 8 layers 0.28-0.34 (at 2 threads, wall clock: 0.101, 0.13-0.17, 0.24-0.27; target 33 ms). So the default keeps the first and the last layer (the head expects the last one's
features) and 16,384 head rows (0.925 of the test references' tokens; 8,192 rows: 0.87, c 0.085).
Cut this way the draft agrees with the target on almost nothing until it is healed by distillation
(distill/heal.py). A derived draft on disk is small: `derived.json` (the recipe: base spec, layers, LoRA
settings, provenance) and `derived.safetensors` (the vocabulary map and the trained delta: LoRA adapters and
norms, a few MB; or whole layers after a full fine-tune). Loading rebuilds the draft from the base, applies
the delta and folds the adapters in, so the result is a plain causal LM with a narrow head.

Limitations: Llama/Qwen2-shaped models only (model.model.layers, model.lm_head, full attention); the
input embedding stays whole (545 MB in fp32 for Qwen2.5).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from osd.errors import InvalidArgument, ModelNotFound
from osd.models.plain import load_plain_model, load_plain_tokenizer, resolve_model_dir
from osd.models.vocab_map import set_vocab_ids

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "drafts"  # shipped derived drafts: derived:<name>
RECIPE, TENSORS = "derived.json", "derived.safetensors"
DELTA = "delta."  # prefix of trained tensors in derived.safetensors


@dataclass
class DeriveConfig:
    base: str = "bundled:qwen2.5-coder-0.5b"  # the model the draft is cut from (any spec load_model takes)
    layers: str = "0,23"  # kept decoder layers, in order (a comma list, ranges a-b allowed); see the module doc
    vocab: int = 16384  # LM head rows: special tokens + the tokens counted most often + lowest ids to fill
    vocab_datasets: str = "gsm8k,spider,code,support"  # datasets whose train-split prompts and references are counted
    vocab_limit: int = 0  # records per dataset counted (0 = all)
    vocab_count_share: float = 0.5  # share of the head chosen by count; the rest are the lowest ids (see choose_vocab)

    def __post_init__(self):
        if self.vocab <= 0:
            raise InvalidArgument(f"vocab must be > 0, got {self.vocab}")
        if self.vocab_limit < 0:
            raise InvalidArgument(f"vocab_limit must be >= 0, got {self.vocab_limit}")
        if not 0.0 <= self.vocab_count_share <= 1.0:
            raise InvalidArgument(f"vocab_count_share must be in [0, 1], got {self.vocab_count_share}")
        parse_layers(self.layers, None)


def parse_layers(spec: str, depth: int | None) -> list[int]:
    """'0,1,20-23' -> [0, 1, 20, 21, 22, 23]; checked against the base's depth when given."""
    out = []
    try:
        for part in str(spec).split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError as e:
        raise InvalidArgument(f"layers must be a comma list of indices or ranges a-b, got {spec!r}") from e
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise InvalidArgument(f"layers must be distinct indices >= 0, got {spec!r}")
    if depth is not None and max(out) >= depth:
        raise InvalidArgument(f"layer {max(out)} does not exist: the base has {depth} decoder layers")
    return out


def choose_vocab(counts: torch.Tensor, size: int, always: list[int], count_share: float = 1.0) -> torch.Tensor:
    """(V,) token counts -> sorted (N,) ids: `always`, then up to count_share * N by count (ties: lower id), then the
    lowest unused ids.

    Qwen2.5's BPE ids run roughly in merge (frequency) order, so low ids are common tokens of any text. Measured on
    the test splits' reference answers (code, gsm8k, spider, finance, chat prompts), with counts from the train
    splits of gsm8k, spider, code and support, the mean share of tokens a 16,384-row head holds: by count only
    0.90 (code 0.80: the code train split is CoNaLa one-liners), lowest ids only 0.907, half and half 0.925.
    """
    vocab_size = counts.shape[0]
    size = min(size, vocab_size)
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[torch.tensor(sorted(set(always)), dtype=torch.long)] = True
    if int(chosen.sum()) > size:
        raise InvalidArgument(f"vocab {size} is smaller than the {int(chosen.sum())} special tokens it must hold")
    by_count = torch.argsort(-counts.double(), stable=True)  # most frequent first, lower id first among equals
    by_count = by_count[(counts[by_count] > 0) & ~chosen[by_count]]
    chosen[by_count[: max(0, min(size - int(chosen.sum()), round(count_share * size)))]] = True
    rest = (~chosen).nonzero().squeeze(1)
    chosen[rest[: size - int(chosen.sum())]] = True
    return chosen.nonzero().squeeze(1)


def token_counts(tokenizer, texts: list[str], vocab_size: int) -> torch.Tensor:
    """(V,) how often each token id occurs in the texts' tokenizations."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for start in range(0, len(texts), 1024):  # batched: a fast tokenizer encodes a batch in one call
        encoded = tokenizer(texts[start : start + 1024], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([i for seq in encoded for i in seq], dtype=torch.long)
        if len(ids):
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def parse_text_source(entry: str, split: str = "train") -> tuple[str, str, int, int | None]:
    """'name[@lang][:split][[start:end]]' -> (name, split, start, end): a slice of one split, in file order, like
    Hugging Face's `test[600:]`. multilingual_qa has a test split only; `multilingual_qa@de:test[600:]` counts
    German records past those a replay streams (it takes the first ones), so a map never peeks at its stream."""
    entry = entry.strip()
    start, end = 0, None
    if entry.endswith("]") and "[" in entry:
        entry, _, bounds = entry[:-1].partition("[")
        first, sep, last = bounds.partition(":")
        try:
            start, end = int(first or 0), (int(last) if last else None) if sep else int(first or 0) + 1
        except ValueError:
            raise InvalidArgument(f"bad slice [{bounds}] in {entry!r}: use [start:end] with integers") from None
        if start < 0 or (end is not None and end < start):
            raise InvalidArgument(f"bad slice [{bounds}] in {entry!r}: need 0 <= start <= end")
    name, sep, own = entry.rpartition(":")
    if sep and own in ("train", "test"):
        entry, split = name, own
    if not entry:
        raise InvalidArgument("empty dataset name in a text source")
    return entry, split, start, end


def source_records(datasets: str, split: str = "train", limit: int = 0) -> list[dict]:
    """The records of comma-separated text sources (parse_text_source: `name[@lang][:split][[start:end]]`, `split` where
    an entry names none), in order; `limit` caps the records per entry (0: no cap). multilingual_qa has a test split
    only, so a draft healed on it names a slice its evaluations do not use (`multilingual_qa@de:test[300:400]`)."""
    from osd.data import load_records

    records = []
    for entry in filter(None, (d.strip() for d in datasets.split(","))):
        name, own_split, start, end = parse_text_source(entry, split)
        count = None if end is None else end - start
        if limit:
            count = min(limit, count) if count is not None else limit
        if count != 0:
            records += load_records(name, own_split, count, offset=start)
    return records


def dataset_texts(datasets: str, split: str = "train", limit: int = 0) -> list[str]:
    """Prompts and reference answers of the datasets' split (datasets without that split contribute nothing).
    An entry may name its own split and slice (parse_text_source); `limit` caps the records per entry."""
    texts = []
    for record in source_records(datasets, split, limit):
        texts.append(str(record["prompt"]))
        if record.get("reference"):
            texts.append(str(record["reference"]))
    return texts


def special_token_ids(tokenizer) -> list[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids |= {i for i in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)) if i is not None}
    return sorted(int(i) for i in ids)


def derive_model(base, layers: list[int], vocab_ids: torch.Tensor, recipe: dict | None = None):
    """Cut `base` in place to the listed decoder layers and an LM head over `vocab_ids` (rows of the base's head)."""
    decoder = base.model.layers
    layers = parse_layers(",".join(map(str, layers)), len(decoder))
    kept = nn.ModuleList([decoder[i] for i in layers])
    for new_index, layer in enumerate(kept):
        layer.self_attn.layer_idx = new_index  # the KV cache is indexed by position in the stack
    base.model.layers = kept
    config = base.config
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    config.num_hidden_layers = len(layers)
    head = base.get_output_embeddings()
    # a head tied to the input embedding: a token off the map has a row to start from (learn/vocab.py swaps the map)
    from_embedding = bool(getattr(config, "tie_word_embeddings", False)) or head.weight is base.get_input_embeddings().weight
    small = nn.Linear(head.in_features, len(vocab_ids), bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        small.weight.copy_(head.weight[vocab_ids])
        if head.bias is not None:
            small.bias.copy_(head.bias[vocab_ids])
    config.tie_word_embeddings = False  # the head is its own (N, H) matrix now
    base.set_output_embeddings(small)
    set_vocab_ids(base, vocab_ids)
    config.osd_derived = {**(recipe or {}), "layers": layers, "head_from_embedding": from_embedding}
    return base.eval().requires_grad_(False)


def base_head_rows(model):
    """For a derived draft: ids -> (n, H) rows of its base's full LM head, read from the base's safetensors files
    (no full head in memory; what a swapped-in token starts from, learn/vocab.py), or the input embedding's rows where
    the base's head was tied to it; None when neither is known."""
    from safetensors import safe_open

    derived = getattr(model.config, "osd_derived", None) or {}
    base = (derived.get("derive") or {}).get("base")
    files = []
    if base:
        try:
            files = sorted(Path(resolve_model_dir(base)).glob("*.safetensors"))
        except Exception:  # a base no longer on this machine: no rows from it
            files = []
    for file in files:
        with safe_open(str(file), "pt") as f:
            if "lm_head.weight" in f.keys():
                return lambda ids, file=file: _rows_of(file, "lm_head.weight", ids)
    if derived.get("head_from_embedding"):
        embed = model.get_input_embeddings().weight
        return lambda ids: embed.detach()[torch.as_tensor(ids, dtype=torch.long)]
    return None


def _rows_of(file: Path, name: str, ids) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        table = f.get_slice(name)
        return torch.stack([table[int(i) : int(i) + 1][0] for i in ids]).float()


def derive_copy(base, layers: list[int], vocab_ids: torch.Tensor, recipe: dict | None = None):
    """A derived draft beside `base`, which stays whole: the kept layers are copied, the embedding is shared."""
    import copy

    shared = [base.model.embed_tokens.weight, base.get_output_embeddings().weight]
    decoder, base.model.layers = base.model.layers, nn.ModuleList()
    try:
        shell = copy.deepcopy(base, memo={id(p): p for p in shared})
    finally:
        base.model.layers = decoder
    shell.model.layers = nn.ModuleList([copy.deepcopy(decoder[i]) for i in layers])
    if getattr(shell.config, "layer_types", None):
        shell.config.layer_types = [shell.config.layer_types[i] for i in layers]
    model = derive_model(shell, list(range(len(layers))), vocab_ids, recipe)
    model.config.osd_derived["layers"] = list(layers)
    return model


def lora_targets(model) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each linear LoRA adapts in a derived draft: every decoder-layer linear, and the head."""
    out = []
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            out += [(parent, name) for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    return out + [(model, "lm_head")]


def add_lora(model, rank: int, alpha: float) -> None:
    """Wrap every LoRA target in a LoRALinear (B = 0: the model computes the same function)."""
    from osd.learn.trainable import LoRALinear

    for parent, name in lora_targets(model):
        setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha))


def norm_parameters(model) -> list[nn.Parameter]:
    """The RMSNorm scales of the kept layers and the final norm (a few thousand numbers; cheap to train)."""
    norms = [model.model.norm] + [n for layer in model.model.layers for n in (layer.input_layernorm,
                                                                              layer.post_attention_layernorm)]
    return [p for n in norms for p in n.parameters()]


def build_derived(config: DeriveConfig, dtype: str = "float32", tokenizer=None):
    """The bundled (or given) base cut to a derived draft -> (model, recipe). Counting the data takes seconds."""
    tokenizer = tokenizer or load_plain_tokenizer(config.base)
    base = load_plain_model(config.base, dtype)
    vocab_size = int(base.config.vocab_size)
    counts = token_counts(tokenizer, dataset_texts(config.vocab_datasets, "train", config.vocab_limit), vocab_size)
    vocab_ids = choose_vocab(counts, config.vocab, [i for i in special_token_ids(tokenizer) if i < vocab_size],
                             config.vocab_count_share)
    recipe = {"derive": asdict(config), "base_depth": len(base.model.layers),
              "counted_tokens": int(counts.sum()), "vocab_coverage_of_counted": float(counts[vocab_ids].sum() / max(1, counts.sum()))}
    model = derive_model(base, parse_layers(config.layers, len(base.model.layers)), vocab_ids, recipe)
    return model, recipe


def widen_vocab_ids(vocab_ids: torch.Tensor, counts: torch.Tensor, add: int) -> torch.Tensor:
    """The map plus up to `add` ids outside it, most counted first (ties: lower id; zero counts never) -> sorted."""
    if add < 0:
        raise InvalidArgument(f"add must be >= 0, got {add}")
    outside = counts.clone()
    outside[vocab_ids] = 0
    order = torch.argsort(-outside.double(), stable=True)[:add]
    return torch.cat([vocab_ids, order[outside[order] > 0]]).unique(sorted=True)


def widen_head_delta(delta: dict[str, torch.Tensor], vocab_ids: torch.Tensor, wider: torch.Tensor,
                     base_head: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Re-index a trained delta's head rows from `vocab_ids` to the wider map: a kept token keeps its trained row;
    a new one gets the LoRA B row 0 (its logit is the base head's) or, for a fully trained head, the base head's row
    (`base_head`: lm_head.weight / lm_head.bias of the base, full vocabulary). Everything else is unchanged."""
    position = torch.full((int(wider.max()) + 1,), -1, dtype=torch.long)
    position[wider] = torch.arange(len(wider))
    kept = position[vocab_ids]
    if bool((kept < 0).any()):
        raise InvalidArgument("the wider map must hold every id of the old one")
    out = {}
    for name, value in delta.items():
        if not name.startswith("lm_head."):
            out[name] = value
            continue
        if name == "lm_head.lora_b":
            rows = value.new_zeros((len(wider),) + tuple(value.shape[1:]))
        elif name in ("lm_head.weight", "lm_head.bias") and base_head is not None and name in base_head:
            rows = base_head[name][wider].to(value.dtype).clone()
        elif name == "lm_head.lora_a":
            out[name] = value
            continue
        else:
            raise InvalidArgument(f"cannot widen the head delta {name!r} (no base rows for the new tokens)")
        rows[kept] = value
        out[name] = rows
    return out


def widen_derived(spec: str, out_dir: str | Path, sources: str, add: int, tokenizer=None) -> Path:
    """A derived draft with a wider head: its map plus the `add` tokens counted most in `sources` (parse_text_source
    entries) that it lacks, trained rows kept, new rows from the base's head. For traffic the map was not chosen for
    (another language: the shipped draft's map holds 0.09-0.34 of Arabic, Chinese, Russian tokens); the new rows are
    untrained, so the draft proposes them as the cut base would until it learns."""
    where = derived_dir(spec)
    recipe = json.loads((where / RECIPE).read_text())
    tensors = load_file(str(where / TENSORS))
    vocab_ids = tensors["vocab_ids"].long()
    base_spec = recipe["derive"]["base"]
    tokenizer = tokenizer or load_plain_tokenizer(base_spec)
    texts = dataset_texts(sources)
    if not texts:
        raise InvalidArgument(f"no texts in {sources!r} to count")
    base = load_plain_model(base_spec, "float32")
    head = base.get_output_embeddings()
    counts = token_counts(tokenizer, texts, head.weight.shape[0])
    wider = widen_vocab_ids(vocab_ids, counts, add)
    base_head = {"lm_head.weight": head.weight.detach()}
    if head.bias is not None:
        base_head["lm_head.bias"] = head.bias.detach()
    delta = {k[len(DELTA):]: v for k, v in tensors.items() if k.startswith(DELTA)}
    delta = widen_head_delta(delta, vocab_ids, wider, base_head)
    counted = counts.sum().clamp(min=1)
    widened = {"from": str(where), "sources": sources, "add": add, "added": len(wider) - len(vocab_ids),
               "vocab": len(wider), "coverage_of_counted_before": float(counts[vocab_ids].sum() / counted),
               "coverage_of_counted_after": float(counts[wider].sum() / counted)}
    new_recipe = {k: v for k, v in recipe.items() if k != "trained"}
    new_recipe["derive"] = {**recipe["derive"], "vocab": len(wider)}
    new_recipe["widened"] = recipe.get("widened", []) + [widened]
    model = derive_model(base, parse_layers(recipe["derive"]["layers"], len(base.model.layers)), wider, new_recipe)
    return save_derived(out_dir, model, new_recipe, delta, recipe.get("trained"))


def save_derived(out_dir: str | Path, model, recipe: dict, delta: dict[str, torch.Tensor] | None = None,
                 trained: dict | None = None) -> Path:
    """Write recipe + vocabulary map + trained delta (names as in the model, LoRA included), atomically."""
    from osd.models.vocab_map import vocab_ids_of

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"vocab_ids": vocab_ids_of(model).to(torch.int32)}
    tensors.update({DELTA + name: t.detach().float().contiguous() for name, t in (delta or {}).items()})
    tmp = out / (TENSORS + ".partial")
    save_file(tensors, str(tmp))
    meta = {**recipe, "trained": trained}
    (out / (RECIPE + ".partial")).write_text(json.dumps(meta, indent=2, default=str))
    tmp.replace(out / TENSORS)
    (out / (RECIPE + ".partial")).replace(out / RECIPE)
    return out


def derived_dir(spec: str) -> Path:
    """`derived:<dir>` or `derived:<name>` of a shipped draft (src/osd/assets/drafts) -> its directory."""
    name = spec.split(":", 1)[1] if spec.startswith("derived:") else spec
    for where in (Path(name).expanduser(), ASSETS / name):
        if (where / RECIPE).exists():
            return where
    shipped = sorted(p.name for p in ASSETS.glob("*") if (p / RECIPE).exists()) if ASSETS.exists() else []
    raise ModelNotFound(f"no derived draft at {name!r} (a directory holding {RECIPE}); shipped: {', '.join(shipped) or 'none'}."
                        " Build one with `osd draft build --out DIR`")


def read_recipe(spec: str) -> dict:
    return json.loads((derived_dir(spec) / RECIPE).read_text())


def load_derived(spec: str, dtype: str = "float32", with_delta: bool = True):
    """Rebuild a derived draft from its base and recipe, apply the trained delta (unless with_delta is False: the
    draft as derived, before healing), fold LoRA in -> a frozen plain model."""
    from osd.learn.trainable import merge_lora

    where = derived_dir(spec)
    recipe = json.loads((where / RECIPE).read_text())
    tensors = load_file(str(where / TENSORS))
    derive = recipe["derive"]
    base = load_plain_model(derive["base"], dtype)
    model = derive_model(base, parse_layers(derive["layers"], len(base.model.layers)), tensors["vocab_ids"].long(),
                         {k: v for k, v in recipe.items() if k != "trained"})
    delta = {k[len(DELTA):]: v for k, v in tensors.items() if k.startswith(DELTA)}
    trained = (recipe.get("trained") or {}) if with_delta else {}
    if delta and with_delta:
        if trained.get("mode") == "lora":
            add_lora(model, trained["lora_rank"], trained["lora_alpha"])
        params = dict(model.named_parameters())
        unknown = sorted(set(delta) - set(params))
        if unknown:
            raise ModelNotFound(f"{where / TENSORS} holds weights this draft does not have ({', '.join(unknown[:3])}): "
                                "made on another base or recipe")
        with torch.no_grad():
            for name, value in delta.items():
                params[name].copy_(value.to(params[name].dtype))
        merge_lora(model)
    model.config.osd_derived = {**model.config.osd_derived, "source": str(where), "trained": trained}
    return model.eval().requires_grad_(False)


def load_restricted_dir(where: str, dtype: torch.dtype):
    """A Hugging Face directory saved from a derived draft (config holds the vocabulary map; head has N rows)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from osd.models.vocab_map import CONFIG_KEY

    config = AutoConfig.from_pretrained(where)
    vocab_ids = torch.as_tensor(getattr(config, CONFIG_KEY), dtype=torch.long)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    head = nn.Linear(config.hidden_size, len(vocab_ids), bias=False, dtype=dtype)
    model.set_output_embeddings(head)
    state = {}
    for file in sorted(Path(where).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelNotFound(f"{where}: weights do not fit its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval().requires_grad_(False)
