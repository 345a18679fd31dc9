"""Integrations with other training systems, each an optional extra.

    verl   `tracetrain[verl]`: the same rows and loss on verl + Ray (see tracetrain.integrations.verl)

Nothing here is imported by the embedded backend.
"""
