"""Train an ALBERT with p2ptrain: with no arguments, a local swarm trains albert-tiny (one block shared by all its
layers, so each stage holds a copy, kept equal) on masked-LM batches of the embedded corpus and shows its progress;
`--help` lists the flags (model size or a local Hugging Face checkpoint, data, tokenizer, batch, optimizer and
schedule), `--plan SWARMFILE` prices the model on a swarm file's devices (the paper's albert-xxlarge included), and
`--print-commands` prints the commands of a run across machines."""
import sys

from p2ptrain.recipe_cli import Family, main

ALBERT = Family(name="albert", description=__doc__,
                sizes={"tiny": "albert-tiny", "small": "albert-small", "albert-xxlarge": "albert-xxlarge"},
                local_sizes=("tiny", "small"))

if __name__ == "__main__":
    sys.exit(main(ALBERT))
