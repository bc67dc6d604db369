"""Model surgery: cut a model at new inputs and outputs (:func:`cut`), join models
(:func:`compose`), edit its interface (:func:`rename`, :func:`add_tail`,
:func:`set_batch`) and embed input preprocessing (:func:`preprocess`). Every function
takes a Model, a path or a ModelProto and returns a new Model; ``docs/surgery.md`` shows
each one."""

from kiln.edit.compose import TAILS, add_tail, compose, rename, set_batch
from kiln.edit.cut import cut
from kiln.edit.preprocess import preprocess

__all__ = ["TAILS", "add_tail", "compose", "cut", "preprocess", "rename", "set_batch"]
