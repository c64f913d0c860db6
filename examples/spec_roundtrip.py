"""PyTorch writes the spec of its encoder's output as JSON; JAX reads it and checks its reference.

    python examples/spec_roundtrip.py

The PyTorch half runs the vision encoder of ``dualgraph.models`` (its blocks graphed) once and
writes to a temporary folder ``spec.json`` (``dualgraph.describe`` of the output: the ``None`` of
``aux_loss``, each array's shape and dtype, the grad mask), the weights and the images. The JAX
half runs in a process of its own that never imports torch: it loads the spec with
``TreeSpec.from_json``, compiles the JAX reference with ``dualgraph.jax.graphed(...,
out_spec=spec)`` (which checks the traced output against the spec and takes its grad mask), runs
it and checks the result with ``spec.check`` and its values against torch's. A reference that
returned ``aux_loss=0.0`` where PyTorch returns ``None`` is refused, with the path named.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import dualgraph

BATCH, IMAGE_SIZE, DIM, DEPTH, HEADS = 2, 32, 64, 2, 4
#: The largest difference allowed between JAX's and torch's float32 outputs (values near 1,
#: two blocks: about 1e-6 in practice); a weight read wrongly moves them by far more.
VALUE_TOLERANCE = 1e-4


def torch_side(folder: Path) -> None:
    """Run the PyTorch encoder once; write its output spec, its weights, its inputs and outputs."""
    import torch

    import dualgraph.torch as dgt
    from dualgraph.models.torch_vit import VisionEncoder

    torch.manual_seed(0)
    encoder = VisionEncoder(image_size=IMAGE_SIZE, dim=DIM, depth=DEPTH, heads=HEADS)
    tokens = (IMAGE_SIZE // 8) ** 2
    sample = torch.randn(BATCH, tokens, DIM, requires_grad=True)
    blocks = tuple(encoder.blocks)
    dgt.make_graphed_callables(blocks, tuple((sample,) for _ in blocks), backend="emulate")
    images = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE)
    out = encoder(images)

    spec = dualgraph.describe(out)
    (folder / "spec.json").write_text(spec.to_json())
    weights = {name: value.detach().numpy() for name, value in encoder.state_dict().items()}
    np.savez(folder / "weights.npz", **weights)
    np.savez(folder / "io.npz", images=images.numpy(), **_arrays_of(spec, out))
    print(f"torch: the encoder returned {spec}")
    print(f"torch: wrote {folder / 'spec.json'} ({len(spec.to_json())} bytes of JSON)")


def jax_side(folder: Path) -> None:
    """Load the spec that PyTorch wrote; hold the JAX reference of the same encoder to it."""
    import jax.numpy as jnp

    import dualgraph.jax as dgj
    from dualgraph.models import jax_vit

    spec = dualgraph.TreeSpec.from_json((folder / "spec.json").read_text())
    print(f"jax: read {spec}")
    masked = [path for path, grad in zip(spec.array_paths, spec.grad_mask, strict=True) if grad]
    print(f"jax: grad mask from torch: cotangents for {', '.join(masked)}")

    params = jax_vit.params_from_state_dict(dict(np.load(folder / "weights.npz")))
    io = np.load(folder / "io.npz")
    images = jnp.asarray(io["images"])
    reference = functools.partial(jax_vit.vision_encoder, heads=HEADS)
    program = dgj.graphed(reference, (params, images), out_spec=spec)  # checks the traced output
    out = program(params, images)
    spec.check(out)  # None where torch has None, same shapes and dtypes
    assert program.out_spec.grad_mask == spec.grad_mask
    differences = [
        float(np.abs(np.asarray(array) - io[_key(path)]).max())
        for path, array in zip(spec.array_paths, spec.flatten(out), strict=True)
    ]
    # numpy's max keeps a NaN, which Python's max drops after a finite value
    difference = float(np.max(differences, initial=0.0))
    # two float32 computations of one model agree closely; a NaN is never within it
    if not difference <= VALUE_TOLERANCE:
        raise AssertionError(
            f"the reference's values differ from torch's by {difference:.3g} "
            f"(more than {VALUE_TOLERANCE:g}): the weights did not load as torch's"
        )
    print(
        "jax: the reference's output matches the spec; largest difference from torch's "
        f"values: {difference:.2g} (at most {VALUE_TOLERANCE:g})"
    )

    def wrong_reference(params: dict, images: jnp.ndarray) -> dict:
        return {**reference(params, images), "aux_loss": jnp.zeros(())}

    try:
        dgj.graphed(wrong_reference, (params, images), out_spec=spec)
    except dualgraph.SpecMismatchError as error:
        print(f"jax: a reference returning aux_loss=0.0 is refused: {error}")
    else:
        raise AssertionError("a reference with aux_loss=0.0 passed the spec check")
    print(f"jax: torch imported in this process: {'yes' if 'torch' in sys.modules else 'no'}")


def _key(path: str) -> str:
    """An npz key for an output path: ``['hidden']`` -> ``out_hidden``."""
    return "out_" + "".join(c if c.isalnum() else "_" for c in path).strip("_")


def _arrays_of(spec: dualgraph.TreeSpec, out: object) -> dict[str, np.ndarray]:
    return {
        _key(path): array.detach().numpy()
        for path, array in zip(spec.array_paths, spec.flatten(out), strict=True)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jax-side", type=Path, help=argparse.SUPPRESS)  # the second process
    args = parser.parse_args()
    if args.jax_side is not None:
        jax_side(args.jax_side)
        return 0
    with tempfile.TemporaryDirectory(prefix="dualgraph-spec-") as folder:
        torch_side(Path(folder))
        sys.stdout.flush()  # before the other process writes to the same output
        jax_process = [sys.executable, __file__, "--jax-side", folder]
        return subprocess.run(jax_process, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
