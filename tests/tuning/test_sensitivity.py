"""Per-layer pool sizes under a fixed total: the grid, interpolation and the exact allocation."""
import itertools

from moetailor.tuning.sensitivity import allocate, grid, interpolate, measure_curves, measured_sizes


def test_grid_and_measured_sizes():
    assert grid(64, 8, 4) == [8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64]
    assert grid(8, 2, 1) == [2, 3, 4, 5, 6, 7, 8]
    assert grid(16, 3, 4) == [4, 8, 12, 16]        # grouped: multiples of the group count, at least k
    sizes = measured_sizes(64, 8, 4)
    assert sizes[0] == 8 and sizes[-1] == 60 and len(sizes) == 7 and 64 not in sizes


def test_interpolation_is_linear_and_zero_at_the_whole_layer():
    curve = {8: 0.4, 32: 0.1}
    assert interpolate(curve, 8, 64) == 0.4
    assert abs(interpolate(curve, 20, 64) - 0.25) < 1e-12
    assert abs(interpolate(curve, 48, 64) - 0.05) < 1e-12
    assert interpolate(curve, 64, 64) == 0.0


def test_allocation_is_the_exact_optimum_of_the_additive_model():
    E, k, step = 16, 2, 2
    # layer 0 is very sensitive, layer 2 barely: the optimum moves experts from 2 to 0
    curves = [{m: 1.0 * (E - m) / E for m in range(2, 16, 2)}, {m: 0.3 * (E - m) / E for m in range(2, 16, 2)},
              {m: 0.01 * (E - m) / E for m in range(2, 16, 2)}]
    total = 24
    got = allocate(curves, total, E, k, step)
    assert sum(got) == total
    g = grid(E, k, step)
    best = min((c for c in itertools.product(g, repeat=3) if sum(c) == total),
               key=lambda c: sum(interpolate(cv, m, E) for cv, m in zip(curves, c)))
    assert sum(interpolate(cv, m, E) for cv, m in zip(curves, got)) <= \
        sum(interpolate(cv, m, E) for cv, m in zip(curves, best)) + 1e-12
    assert got[0] == E and got[2] <= got[1]
    assert allocate(curves, 5, E, k, step) is None       # below three layers at k: no allocation


def test_curves_probe_one_layer_at_a_time():
    seen = []
    curves = measure_curves(lambda alloc: seen.append(tuple(alloc)) or float(sum(8 - m for m in alloc)), 3, 8, [2, 4])
    assert seen == [(2, 8, 8), (4, 8, 8), (8, 2, 8), (8, 4, 8), (8, 8, 2), (8, 8, 4)]
    assert curves[1] == {2: 6.0, 4: 4.0}
