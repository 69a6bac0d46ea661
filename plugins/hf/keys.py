"""The hf engine's config keys, added to the sections of its train and forward roles (`EngineSpec.keys`): its
kernels, packing and compilation, named as transformers' TrainingArguments (and TRL) name them
(`train.liger_kernel`). Unset, the engine's own default holds (`HFOptions`); `engine_kwargs` takes them too."""

from __future__ import annotations

from pydantic import BaseModel, Field

from rlcore.bounds import MAX_MICRO_TOKENS

ONLY = {"engine_only": True}  # set under another train engine, a key of this one is refused


class HFForwardKeys(BaseModel):
    """What the hf engine takes as a forward-only model (a reference, a teacher) too."""

    padding_free: bool | None = Field(
        None, json_schema_extra=ONLY, description="pack rows without padding (engine hf; unset: only with a variable-length attention kernel, and never for models whose layers carry a state)")
    chunked_lm_head: bool | None = Field(
        None, json_schema_extra=ONLY, description="log-probs from the LM head in chunks of rows, never the whole logits (engine hf; unset: on)")
    attn_implementation: str | None = Field(
        None, json_schema_extra=ONLY, description="transformers' attention kernel (engine hf; unset: transformers' default)")
    liger_kernel: bool | None = Field(None, json_schema_extra=ONLY, description="Liger's fused kernels (engine hf; unset: off)")
    torch_compile: bool | None = Field(None, json_schema_extra=ONLY, description="torch.compile the decoder layers (engine hf; unset: off)")
    torch_compile_backend: str | None = Field(None, json_schema_extra=ONLY, description="torch.compile backend (engine hf; unset: inductor)")
    torch_compile_mode: str | None = Field(None, json_schema_extra=ONLY, description="torch.compile mode (engine hf; unset: torch's default)")


class HFTrainKeys(HFForwardKeys):
    """The hf train engine's keys: the forward ones plus the token budget of a packed micro-batch."""

    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, le=MAX_MICRO_TOKENS, json_schema_extra=ONLY, description="tokens of one packed micro-batch at most (engine hf, with padding_free; unset: the rows' own)")


__all__ = ["HFForwardKeys", "HFTrainKeys"]
