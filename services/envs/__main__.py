"""``python -m services.envs``: parse the config, run the service; SIGTERM stops it cleanly."""

from bus.stopping import install_early

install_early()  # before the heavy imports below: a stop during them still ends in exit 0

from bus.config import main_config  # noqa: E402
from bus.service import main  # noqa: E402
from services.envs.config import EnvsConfig  # noqa: E402
from services.envs.service import run  # noqa: E402

main(run, main_config(EnvsConfig, "python -m services.envs"))
