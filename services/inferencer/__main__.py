"""``python -m services.inferencer [--target-batch B] [--max-wait-ms T] ...``"""

import asyncio

from bus.config import main_config
from services.inferencer import InferencerConfig, run

asyncio.run(run(main_config(InferencerConfig, "python -m services.inferencer")))
