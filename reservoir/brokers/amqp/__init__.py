"""What the two RabbitMQ drivers share: the sans-I/O session
(:mod:`reservoir.brokers.amqp.session`), which decides everything, and the threaded front
(:mod:`reservoir.brokers.amqp.threaded`), which callers' threads talk to. A driver
(:mod:`reservoir.brokers.pika_broker`, :mod:`reservoir.brokers.kombu_broker`) only carries out the
session's actions with its client library and reports that library's events back."""
