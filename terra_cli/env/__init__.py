"""terra as a closed-loop driving simulator (gymnasium): `TerraEnv`, `TerraVectorEnv` (with
`fork` / `select` branches). Needs the `env` extra (gymnasium). docs/simulator.md is the guide."""

from __future__ import annotations

ENV_INSTALL_HINT = "pip install 'terra-cli[env]'"


def require_gymnasium(reason: str) -> None:
    """Checked before anything loads: `terra bench --env` would otherwise load and step an engine
    first, then fail on the import."""
    from terra_cli.errors import import_extra

    import_extra("gymnasium", f"{reason} runs terra's closed-loop simulator, which needs gymnasium, not installed: "
                 f"{ENV_INSTALL_HINT}")


def __getattr__(name: str):
    if name == "TerraVectorEnv":
        from terra_cli.env.vector import TerraVectorEnv

        return TerraVectorEnv
    if name == "TerraEnv":
        from terra_cli.env.single import TerraEnv

        return TerraEnv
    raise AttributeError(name)


__all__ = ["TerraEnv", "TerraVectorEnv"]
