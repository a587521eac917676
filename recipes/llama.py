"""Train a Llama with p2ptrain: with no arguments, a local swarm trains llama-tiny on the embedded corpus and shows
its progress; `--help` lists the flags (model size or a local Hugging Face checkpoint, data, tokenizer, batch,
optimizer and schedule), `--plan SWARMFILE` prices the model on a swarm file's devices, and `--print-commands`
prints the commands of a run across machines."""
import sys

from p2ptrain.recipe_cli import Family, main

LLAMA = Family(name="llama", description=__doc__, sizes={"tiny": "llama-tiny", "small": "llama-small", "llama-33b": "llama-33b"},
               local_sizes=("tiny", "small"))

if __name__ == "__main__":
    sys.exit(main(LLAMA))
