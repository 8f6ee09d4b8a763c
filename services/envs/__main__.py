import asyncio

from bus.config import main_config
from services.envs.service import EnvsConfig, run

asyncio.run(run(main_config(EnvsConfig, "python -m services.envs")))
