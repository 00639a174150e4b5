"""Comparisons, tables and plots: what the teaching commands, notebooks and docs show.

``compare.py`` trains each stage and sets measured bytes and memory beside the formulas;
``tables.py`` turns ``zerosim.analysis`` into the rows the commands print; ``plots.py`` draws
them (matplotlib, no display needed). Nothing below this package imports it.
"""
