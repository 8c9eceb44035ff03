"""Statistics for tests that compare samples (torch only: scipy is not a dependency)."""

import torch


def chi_square_p_value(counts_a, counts_b):
    """Homogeneity test of two samples' token counts; the p-value is chi-square's survival function,
    ``Q(df / 2, statistic / 2)`` (regularised upper incomplete gamma), as scipy is not a dependency."""
    table = torch.stack([counts_a, counts_b]).double()
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    degrees_of_freedom = table.shape[1] - 1
    return torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2, dtype=torch.float64), statistic / 2).item()
