"""The bottom layer: the base exception, argument checks and number formats every layer uses.

It imports nothing from the package; everything else may import it.
"""
