"""Our keys of vLLM's `--additional-config` (under "dsv41"), validated without vLLM, so
`dsv41 serve` rejects a bad value in one line before vLLM starts and the plugin applies the
same rules inside vLLM's workers."""

from __future__ import annotations

REPLAY_MODES = ("window", "exact")
KNOWN_KEYS = ("engram_offload", "replay")


def plugin_options(additional_config: dict | None) -> dict:
    """{"replay": ..., "engram_offload": ...} from vLLM's additional config dict."""
    extra = (additional_config or {}).get("dsv41", {}) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"dsv41: --additional-config \"dsv41\" must be an object, got {extra!r}")
    unknown = set(extra) - set(KNOWN_KEYS)
    if unknown:
        raise ValueError(f"dsv41: unknown --additional-config keys {sorted(unknown)} (known: {list(KNOWN_KEYS)})")
    replay = extra.get("replay", "window")
    if replay not in REPLAY_MODES:
        raise ValueError(f"dsv41: additional_config replay must be one of {REPLAY_MODES}, got {replay!r}")
    offload = extra.get("engram_offload", False)
    if not isinstance(offload, bool):
        raise ValueError(f"dsv41: additional_config engram_offload must be true or false, got {offload!r}")
    return {"replay": replay, "engram_offload": offload}
