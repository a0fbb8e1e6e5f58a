"""Several named drafts as peft LoRA adapters on one shared, frozen base draft (issue 18, item 1).

One peft model holds every draft's adapter (multi-adapter: add, switch, delete, state dicts): a draft is its
adapter's weights on the top `train_layers` decoder layers of the base; the base itself never trains. A draft
is created at runtime from the base (a fresh adapter: B = 0, so it equals the base) or as a copy of another
draft's adapter, and retired. peft keeps ONE adapter active at a time as module state, so every use of the
trainable master (a learner's update, scoring every draft) runs under `use(name)`: one lock, switch, work.

Serving copies, built on publish: the base's serving copy (int8 / truncated vocabulary as ModelConfig says) is
built once; a draft's copy shares every module of it except the adapted linears of its top layers:
  serving="adapter": the shared serving linear plus the low-rank update at runtime (a draft costs its adapter
                     only; a few small matmuls per adapted linear per token);
  serving="merged":  the adapter folded into a new linear in the base's serving form (int8 or fp32): no extra
                     work per token, and a draft costs its adapted linears.
Bytes (`tensor_bytes`): with the 0.5B draft, rank 8 on the top 4 layers, an adapter is ~1 MB against ~2 GB of
fp32 master; five drafts cost well under 1.5x one in either mode (merged: five top-4-layer int8 copies, ~0.3 GB).

Limitations: Llama/Qwen2-shaped drafts (model.model.layers); LoRA only (peft's other tuners are not wired);
torch's dynamic int8 (used when the rows kernel cannot be built) keeps packed weights that `tensor_bytes`
does not see.
"""
from __future__ import annotations

import copy
import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from osd.drafts import DraftRegistry, DraftSnapshot
from osd.errors import DraftNotFound, InvalidArgument
from osd.learn.trainable import decoder_layers, split_index

SERVING = ("adapter", "merged")
PREFIX = "draft_"  # peft's adapter name for draft d is "draft_d": a short name could hide in peft's "lora_" prefix
LINEARS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass
class AdapterConfig:
    rank: int = 8  # LoRA rank of every draft's adapter
    alpha: float = 16.0  # LoRA scale = alpha / rank
    train_layers: int = 4  # adapters on the top N decoder layers (0 = all); the learners' frozen-trunk split
    modules: str = LINEARS  # comma-separated names of the adapted linears in each of those layers
    serving: str = "adapter"  # adapter | merged (module docstring)
    seed: int = 0  # new adapters' A matrices are drawn from seed + creation index

    def __post_init__(self):
        if self.rank <= 0 or self.alpha <= 0 or self.train_layers < 0:
            raise InvalidArgument("adapter rank and alpha must be > 0, train_layers >= 0")
        if self.serving not in SERVING:
            raise InvalidArgument(f"adapter serving must be one of {SERVING}, got {self.serving!r}")
        if not self.module_names():
            raise InvalidArgument("adapter modules: name at least one linear (e.g. q_proj,v_proj)")

    def module_names(self) -> list[str]:
        return [m.strip() for m in self.modules.split(",") if m.strip()]


def adapter_key(name: str) -> str:
    return PREFIX + name


def draft_name(key: str) -> str:
    return key.removeprefix(PREFIX)


class AdapterLinear(nn.Module):
    """A shared serving linear plus a draft's frozen low-rank update: y = base(x) + scale * B A x."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float):
        super().__init__()
        self.base, self.scale = base, float(scale)
        self.register_buffer("lora_a", lora_a.detach().float().clone())  # (r, in)
        self.register_buffer("lora_b", lora_b.detach().float().clone())  # (out, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class AdapterDrafts:
    """Named drafts = LoRA adapters on one frozen base; publishes each draft's serving copy into `registry`."""

    def __init__(self, base, config: AdapterConfig | None = None, registry: DraftRegistry | None = None,
                 quantize: str = "none", draft_vocab: int = 0, keep_ids: list[int] = ()):
        from osd.models.serving_draft import make_serving_draft

        self.config = config or AdapterConfig()
        self.registry = registry if registry is not None else DraftRegistry()
        self.base = base.requires_grad_(False).eval()
        self.split = split_index(base, self.config.train_layers)
        # built before peft touches the base: the serving form every draft's copy shares
        self.serving_base, self.vocab_ids = make_serving_draft(base, quantize, draft_vocab, list(keep_ids))
        self.peft = None  # the peft model, made with the first adapter
        self.lock = threading.RLock()
        self._names: tuple[str, ...] = ()  # sorted; replaced whole (under the lock) by create / retire
        self._created = 0

    # --- adapters -------------------------------------------------------------------------------
    @property
    def master(self):
        """The base with every adapter injected (a plain HF causal LM): what learners train, under `use`."""
        if self.peft is None:
            raise DraftNotFound("no adapter draft has been created yet")
        return self.peft.base_model.model

    def names(self) -> list[str]:
        """Without the lock (a learner's update holds it for seconds): the names as of the last create / retire."""
        return list(self._names)

    def _refresh_names(self) -> None:
        """(Under the lock, after peft's adapters changed.)"""
        self._names = tuple(sorted(draft_name(k) for k in self.peft.peft_config))

    def lora_config(self):
        from peft import LoraConfig

        layers = list(range(self.split, len(decoder_layers(self.base))))
        return LoraConfig(r=self.config.rank, lora_alpha=self.config.alpha, lora_dropout=0.0,
                          target_modules=self.config.module_names(), layers_to_transform=layers, layers_pattern="layers")

    def create(self, name: str, copy_from: str | None = None, publish: bool = True) -> DraftSnapshot | None:
        """A new draft: a fresh adapter (equal to the base), or a copy of `copy_from`'s adapter; published unless told."""
        from peft import get_peft_model

        if not name or any(ch in name for ch in ",+.") or not name.isprintable():
            raise InvalidArgument(f"a draft name must be non-empty, printable, without ',', '+' or '.': {name!r}")
        with self.lock:
            if name in self.names():
                raise InvalidArgument(f"a draft named {name!r} exists already")
            if copy_from is not None:
                self._check(copy_from)
            with torch.random.fork_rng():  # the adapter's A is drawn from the global generator: seed it
                torch.manual_seed(self.config.seed + self._created)
                if self.peft is None:
                    self.peft = get_peft_model(self.base, self.lora_config(), adapter_name=adapter_key(name))
                else:
                    self.peft.add_adapter(adapter_key(name), self.lora_config())
            self._created += 1
            self._refresh_names()
            if copy_from is not None:
                self.load_state(name, self.state(copy_from))
            return self.publish(name) if publish else None

    def retire(self, name: str) -> None:
        """Drop a draft's adapter and its serving copy (requests holding its snapshot finish with it)."""
        with self.lock:
            self._check(name)
            if len(self.names()) == 1:
                raise InvalidArgument(f"{name!r} is the last draft; create another before retiring it")
            if self.peft.active_adapter == adapter_key(name):
                self.peft.set_adapter(adapter_key(next(n for n in self.names() if n != name)))
            self.peft.delete_adapter(adapter_key(name))
            self._refresh_names()
            if name in self.registry.names():
                self.registry.remove(name)

    @contextmanager
    def use(self, name: str):
        """Hold the lock with `name`'s adapter active (and the only trainable parameters): yields the master."""
        with self.lock:
            self._check(name)
            self.peft.set_adapter(adapter_key(name))
            yield self.master

    def parameters(self, name: str) -> list[nn.Parameter]:
        """The adapter's parameters, in a fixed order."""
        with self.lock:
            self._check(name)
            return [p for n, p in self.master.named_parameters() if "lora_" in n and n.endswith(f".{adapter_key(name)}.weight")]

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's weights with the adapter's name left out of the keys (loadable under any name)."""
        from peft.utils import get_peft_model_state_dict

        with self.lock:
            self._check(name)
            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.peft, adapter_name=adapter_key(name)).items()}

    def load_state(self, name: str, state: dict[str, torch.Tensor]) -> None:
        from peft.utils import set_peft_model_state_dict

        with self.lock:
            self._check(name)
            result = set_peft_model_state_dict(self.peft, state, adapter_name=adapter_key(name))
            missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter_key(name)}." in k]
            if missing or result.unexpected_keys:
                raise InvalidArgument(f"adapter weights do not fit draft {name!r} (missing {missing[:2]}, "
                                      f"unexpected {list(result.unexpected_keys)[:2]}): another rank or layer set?")

    def _check(self, name: str) -> None:
        if name not in self.names():
            raise DraftNotFound(f"no draft named {name!r}; known: {self.names()}")

    # --- serving copies -------------------------------------------------------------------------
    def publish(self, name: str, version: int | None = None) -> DraftSnapshot:
        """Build `name`'s serving copy from its adapter as it is now and publish it (a new version)."""
        from osd.memory import trim

        with self.lock:
            replaced = self._serving_linears(name)
        snapshot = self.registry.publish(name, shell_copy(self.serving_base, replaced), self.vocab_ids, version)
        trim()
        return snapshot

    def _serving_linears(self, name: str) -> dict[str, nn.Module]:
        """Qualified name -> the draft's serving module for every adapted linear."""
        from peft.tuners.lora import LoraLayer

        out = {}
        for qname, module in self.master.named_modules():
            key = adapter_key(name)
            if not isinstance(module, LoraLayer) or key not in module.lora_A:
                continue
            shared = self.serving_base.get_submodule(qname)
            a, b, scale = module.lora_A[key].weight, module.lora_B[key].weight, module.scaling[key]
            if self.config.serving == "adapter":
                out[qname] = AdapterLinear(shared, a, b, scale)
            else:
                base = module.get_base_layer()
                merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
                with torch.no_grad():
                    merged.weight.copy_(base.weight.float() + (b.float() @ a.float()) * scale)
                    if base.bias is not None:
                        merged.bias.copy_(base.bias.float())
                out[qname] = serving_form(merged.requires_grad_(False), like=shared)
        return out

    def tensor_bytes(self) -> dict:
        """Bytes of distinct tensor storage: the master (base + every adapter), the serving copies, and both;
        one_draft: what one draft without adapters holds (the base's master weights and its serving copy), so
        total / one_draft is what the drafts cost against serving one (issue 18: <= 1.5x for five)."""
        served = [self.registry.get(n).model for n in self.registry.names()]
        master = self.master if self.peft is not None else self.base
        adapters = {n: sum(p.numel() * p.element_size() for p in self.parameters(n)) for n in self.names()}
        return {"master": tensor_bytes(master), "adapters": adapters,
                "serving": tensor_bytes(self.serving_base, *served),
                "total": tensor_bytes(master, self.serving_base, *served),
                "one_draft": tensor_bytes(master, self.serving_base) - sum(adapters.values())}


def serving_form(linear: nn.Linear, like: nn.Module) -> nn.Module:
    """`linear` in the serving form of `like` (our int8 kernel linear, torch's dynamic int8, or plain fp32)."""
    from osd.models.serving_draft import Int8Linear

    if isinstance(like, Int8Linear):
        return Int8Linear(linear, like.kernel)
    if type(like) is nn.Linear:
        return linear
    return torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]


def shell_copy(model, replaced: dict[str, nn.Module]):
    """A copy of `model` that shares every tensor and every module except the ancestors of `replaced`
    (qualified name -> module); those are fresh shells holding the replacements. `model` is unchanged."""
    ancestors = {""}
    for qname in replaced:
        parts = qname.split(".")
        ancestors |= {".".join(parts[:i]) for i in range(len(parts))}
    memo = {id(m): m for qname, m in model.named_modules() if qname not in ancestors}
    memo.update({id(t): t for t in itertools.chain(model.parameters(), model.buffers())})
    for attr in ("config", "generation_config"):
        if getattr(model, attr, None) is not None:
            memo[id(getattr(model, attr))] = getattr(model, attr)
    shell = copy.deepcopy(model, memo)
    for qname, module in replaced.items():
        parent, _, leaf = qname.rpartition(".")
        setattr(shell.get_submodule(parent), leaf, module)
    return shell.eval()


def tensor_bytes(*modules) -> int:
    """Bytes of the distinct storages behind the modules' parameters and buffers (shared ones counted once)."""
    seen = {}
    for module in modules:
        for t in itertools.chain(module.parameters(), module.buffers()):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
