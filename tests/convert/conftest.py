import os
import sys

# Reuse the tiny-model helpers of tests/models.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
