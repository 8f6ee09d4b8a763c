import asyncio

from bus.config import main_config
from services.master import MasterConfig, run

asyncio.run(run(main_config(MasterConfig, "python -m services.master")))
