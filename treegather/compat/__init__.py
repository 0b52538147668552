"""Drop-in replacements for older data-parallel APIs, built on treegather's functions.

Import the submodule you need, e.g. ``from treegather.compat.jactorch import dict_gather_v2``;
``import treegather`` does not import these.
"""
