import sys
from pathlib import Path

# tests import their helpers (exhaustive.py) directly
sys.path.insert(0, str(Path(__file__).parent))
