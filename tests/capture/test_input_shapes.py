"""What the report calls the step's size: `seq N` when the example batch follows the sequence length, the
input's shape when it does not (an image model, whose example_batch ignores seq)."""
import os

from tracer.capture import load_model_source, seq_free_input_shapes
from tracer.cli import main
from tracer.errors import ExitCode

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FIXED_INPUT = os.path.join(FIXTURES, "library_optimizer_net.py")      # example_batch: randn(batch, 1024)
TOKENS = os.path.join(FIXTURES, "autocast_cached_weights.py")          # example_batch: (batch, seq) tokens


def test_a_batch_that_ignores_seq_is_named_by_its_shape():
    assert seq_free_input_shapes(load_model_source(FIXED_INPUT), 2, 8) == "2x1024"
    assert seq_free_input_shapes(load_model_source(TOKENS), 2, 8) is None


def test_the_header_names_the_input_shape_instead_of_seq(capsys):
    assert main([FIXED_INPUT, "--batch", "2", "--seq", "8", "--target", "cpu", "--quiet", "--no-cache"]) == ExitCode.OK
    header = capsys.readouterr().out.splitlines()[0]
    assert "batch 2  input 2x1024  fp32" in header and "seq" not in header
