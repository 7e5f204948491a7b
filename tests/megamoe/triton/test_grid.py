"""The launchers' plain-Python grid helpers give Triton's values."""

import triton

from megamoe.backends.triton.grid import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    for n in [*range(0, 4100), 65535, 65536, 65537, 1 << 31, (1 << 31) + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
