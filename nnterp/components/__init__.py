"""Components: one file per kind of module nnterp standardizes."""
