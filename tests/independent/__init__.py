"""Wrong answers written blind, to measure how well the grader names mistakes (issue 34)."""
