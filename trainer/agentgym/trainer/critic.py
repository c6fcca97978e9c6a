"""The PPO critic: a SEPARATE value model (its own backbone and a scalar head), as in verl / AgentGym-RL.

``ValueModel`` = the policy's decoder architecture, initialised from the same weights as the
policy (``AutoModelForCausalLM`` loaded, its decoder kept, the LM head dropped) plus a linear head
``hidden -> 1`` initialised to zero (so the first values are 0 and the first advantages are the
plain discounted rewards). It is trained with its own optimiser and ``critic_learning_rate``; it
shares nothing with the policy, so value-loss gradients never disturb the policy.

Alignment: the value of response token ``t`` is ``V(s_t)``, the value of the state in which token
``t`` was sampled, read from the hidden state at the position BEFORE ``t`` (the same position whose
logits scored token ``t``). Checkpointed under ``critic/`` of a checkpoint: the backbone as an HF
folder (safetensors) and ``value_head.safetensors``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from agentgym.trainer.packed_attention import PACKED_ATTENTION, register_packed_attention
from agentgym.trainer.packing import PackedRow, attention_kind, row_hidden_states

__all__ = ["ValueModel"]


class ValueModel(nn.Module):
    """Decoder backbone + scalar value head."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> Any:
        return getattr(self.backbone, "config", None)

    @classmethod
    def from_policy_folder(cls, folder: str | Path, dtype: torch.dtype, attn_implementation: str | None) -> ValueModel:
        """A critic whose backbone starts from the policy weights in ``folder``."""
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": dtype}
        if attn_implementation == PACKED_ATTENTION:
            register_packed_attention()
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        lm = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
        backbone = lm.get_decoder()
        return cls(backbone, int(lm.config.hidden_size)).to(dtype)

    def values(self, row: PackedRow, autocast_dtype: torch.dtype | None = None) -> list[Tensor]:
        """Per-sequence values ``[response_length]`` for the sequences of ``row``."""
        device = self.value_head.weight.device
        kind = attention_kind(self.backbone)
        with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            hidden = row_hidden_states(self.backbone, row, kind, autocast_dtype or self.value_head.weight.dtype, device)
            selected = hidden.index_select(0, row.score_positions().to(device))
            values = self.value_head(selected).squeeze(-1).float()
        return row.split_scores(values)

    def save(self, folder: str | Path) -> None:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        save_pretrained = getattr(self.backbone, "save_pretrained", None)
        if save_pretrained is None:
            raise TypeError("the critic backbone cannot save_pretrained")
        save_pretrained(str(out))
        head = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(head, str(out / "value_head.safetensors"))

    def load(self, folder: str | Path) -> None:
        from agentgym.trainer.checkpoint import load_hf_weights

        path = Path(folder)
        load_hf_weights(self.backbone, path)
        head = load_file(str(path / "value_head.safetensors"))
        self.value_head.load_state_dict(head)
