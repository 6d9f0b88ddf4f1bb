"""Which config fields are secrets, and the config with them removed (`public_config`): what
config.json, checkpoints, wandb and `--print-config` get. No JAX here."""

from __future__ import annotations

# A field is secret when its name contains one of these words (case and separators aside):
# apikey, wandbApiKey, hf_token, secrets, passwd, credentials, auth_header... lclm's own
# fields that merely contain one of them are named in _NOT_SECRET (a test keeps it exact).
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential", "auth")
_NOT_SECRET = frozenset(
    {"tokenizer", "tokens_per_batch", "passkey", "passkey_samples", "passkey_depths"}
)


def is_secret(name: str) -> bool:
    name = name.lower()
    return name not in _NOT_SECRET and any(w in name for w in _SECRET_WORDS)


def public_config(config) -> dict:
    """The config as a plain dict with every secret-named field removed (what config.json,
    checkpoints and wandb get)."""

    def clean(d):
        return {k: clean(v) if isinstance(v, dict) else v for k, v in d.items() if not is_secret(k)}

    return clean(config.to_dict())
