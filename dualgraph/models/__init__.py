"""Reference models shared by the tests, the parity harness's tests and the examples.

- :mod:`dualgraph.models.torch_vit`: ``ViTBlock`` and ``VisionEncoder`` in PyTorch;
- :mod:`dualgraph.models.jax_vit`: the same math as JAX functions of a params pytree, with
  ``params_from_state_dict`` to load the PyTorch weights.

Import the submodule you need; this package imports neither framework.
"""

__all__: list[str] = []
