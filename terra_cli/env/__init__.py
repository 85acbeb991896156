"""terra as a closed-loop driving simulator (gymnasium): `TerraEnv`, `TerraVectorEnv` (with
`fork` / `select` branches). Needs the `env` extra (gymnasium). docs/simulator.md is the guide."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "TerraVectorEnv":
        from terra_cli.env.vector import TerraVectorEnv

        return TerraVectorEnv
    if name == "TerraEnv":
        from terra_cli.env.single import TerraEnv

        return TerraEnv
    raise AttributeError(name)


__all__ = ["TerraEnv", "TerraVectorEnv"]
