import asyncio

from bus.config import main_config
from services.trainer import TrainerConfig, run

asyncio.run(run(main_config(TrainerConfig, "python -m services.trainer")))
