"""Nested integer expressions, reduced one innermost operation per line.

The true answer is computed by a small ``ast`` walker (never ``eval``), so the scorer does not
trust the trace generator.
"""
from __future__ import annotations

import ast
import operator
import random

from .base import Example, make_example

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_SYMBOL = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult}


def evaluate(expression: str) -> int:
    """Integer value of an expression of ints, + - * and parentheses; anything else raises."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported syntax in expression {expression!r}: {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval"))


# A tree is an int leaf or a tuple (op, left, right).
Tree = int | tuple


def _random_tree(rng: random.Random, n_ops: int) -> Tree:
    if n_ops == 0:
        return rng.randrange(1, 10)
    left_ops = rng.randrange(0, n_ops)
    op = rng.choice("+-*+-")  # fewer products keeps values small
    return (op, _random_tree(rng, left_ops), _random_tree(rng, n_ops - 1 - left_ops))


def render(tree: Tree, top: bool = True) -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    text = f"{render(left, False)}{op}{render(right, False)}"
    return text if top else f"({text})"


def _reduce_once(tree: Tree) -> Tree:
    """Replace the leftmost operation whose operands are both numbers by its value."""
    op, left, right = tree
    if isinstance(left, int) and isinstance(right, int):
        return _OPS[_SYMBOL[op]](left, right)
    if not isinstance(left, int):
        return (op, _reduce_once(left), right)
    return (op, left, _reduce_once(right))


# Every leaf and intermediate value is a single (signed) digit: each reduction step is then one
# fact from a table of a few hundred, which a small model learns. Difficulty is the nesting depth.
VALUE_BOUND = 10


def generate(rng: random.Random, difficulty: int) -> Example:
    n_ops = difficulty + 1
    while True:
        tree = _random_tree(rng, n_ops)
        if all(abs(evaluate(render(t))) < VALUE_BOUND for t in _subtrees(tree)):
            break
    prompt = f"eval {render(tree)}\n"
    trace = []
    while not isinstance(tree, int):
        tree = _reduce_once(tree)
        trace.append(render(tree))
    answer = str(evaluate(prompt[5:].strip()))
    assert answer == trace[-1]
    return make_example("expressions", difficulty, prompt, trace[:-1], answer)


def _subtrees(tree: Tree) -> list[Tree]:
    if isinstance(tree, int):
        return [tree]
    return [tree, *_subtrees(tree[1]), *_subtrees(tree[2])]
