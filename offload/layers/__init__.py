"""Finding a model's layers and hooking their boundaries, for the entry points.

Its one job: turn what a user passes (a ModuleList, a model, names) into the layers the engine
counts, and tell it where each begins and ends.

- ``find``: the layer list inside common model classes;
- ``args``: ``OffloadActivations``' arguments checked and resolved into layers and options;
- ``hooks``: the forward hooks that open and close a layer's group;
- ``model_form``: the model-level form (a stand-in on ``model.forward`` that plans each shape at
  the model's entry and can probe a long first batch short);
- ``short_probe``: that short probe's step, cut from the user's call and invisible to the user.
"""
