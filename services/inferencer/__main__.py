import asyncio

from bus.config import main_config
from services.inferencer import InferencerConfig, run

asyncio.run(run(main_config(InferencerConfig, "python -m services.inferencer")))
