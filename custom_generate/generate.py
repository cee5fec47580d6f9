"""rift-ada as a transformers ``custom_generate`` method, loadable by path (or from a hub repository holding this
folder): ``target.generate(**inputs, assistant_model=draft, custom_generate="path/to/rift-ada",
trust_remote_code=True, rift_policy="rift-dyn", rift_budget=512)``.

transformers hands a method loaded this way every argument of ``generate`` and no input preparation; handing them
back to ``generate`` with ``rift_ada.hf.rift_generate`` as the decoding loop gives the same preparation and the same
loop as passing the callable directly (``rift_ada.hf`` documents the ``rift_*`` arguments). Needs ``rift-ada``
installed (``pip install -e .`` in the checkout).
"""

from rift_ada.hf import rift_generate


def generate(model, **kwargs):
    return model.generate(custom_generate=rift_generate, **kwargs)
