import os
import unittest

import statlib


class MedianTests(unittest.TestCase):
    def test_median_even(self):
        expected = float(os.environ["STATLIB_EXPECT"])  # [verifier] env
        self.assertEqual(statlib.median([4, 1, 3, 2]), expected)

    def test_median_odd(self):
        self.assertEqual(statlib.median([3, 1, 2]), 2)
