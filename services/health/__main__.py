import asyncio

from bus.config import main_config
from services.health import HealthConfig, run

asyncio.run(run(main_config(HealthConfig, "python -m services.health")))
