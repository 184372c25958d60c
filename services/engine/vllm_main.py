"""The engine process's main module: vLLM's OpenAI API server, run from a module that costs
nothing to import.

vLLM starts its engine core and workers with ``spawn`` on CPU, and a spawned child first
imports its parent's main module (as ``__mp_main__``). Started as ``python -m
vllm.entrypoints.openai.api_server``, the engine core imported the whole API server
(FastAPI, the OpenAI protocol models, tool and reasoning parsers) before its own work, and
its worker did the same again: seconds of CPU per process on every engine start and
restart. With this module as the main one, each child imports only what it uses.
"""

from __future__ import annotations

import runpy


def main() -> None:
    """Run vLLM's API server as ``python -m vllm.entrypoints.openai.api_server`` would, with
    the same arguments (``sys.argv``)."""
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")


if __name__ == "__main__":
    main()
