package main

import (
	"context"
	"fmt"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

// The amqp scenario: as the nats one (broker_nats.go), into RabbitMQ: a
// topic exchange and one queue bound to every key, both fresh per drain.

func amqpBenchURL() string {
	if u := os.Getenv("OUTBOX_AMQP_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

func runBrokerAMQP(ctx context.Context, e *env, c config, r *report) error {
	conn, err := amqp.DialConfig(amqpBenchURL(), amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
	if err != nil {
		return brokerUnavailable(r, "RabbitMQ server", amqpBenchURL(), "OUTBOX_AMQP_URL", err)
	}
	defer conn.Close()
	admin, err := conn.Channel()
	if err != nil {
		return err
	}
	name := fmt.Sprintf("bench.%d", os.Getpid())
	fresh := func() error {
		_, _ = admin.QueueDelete(name, false, false, false)
		if err := admin.ExchangeDeclare(name, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := admin.QueueDeclare(name, true, false, false, false, nil); err != nil {
			return err
		}
		return admin.QueueBind(name, "#", name, false, nil)
	}
	defer func() {
		_, _ = admin.QueueDelete(name, false, false, false)
		_ = admin.ExchangeDelete(name, false, false)
	}()
	pub, err := outboxamqp.New(conn, outboxamqp.WithExchange(name))
	if err != nil {
		return err
	}
	defer pub.Close()
	msgs := brokerMessages(c.backlog, c.aggregates)
	cfg := fmt.Sprintf("1 dispatcher, batch %d", brokerBatch)
	specs := []drainSpec{
		{"outbox → outboxamqp", cfg, fmt.Sprintf("amqp_outbox_b%d", brokerBatch), func() (drainResult, error) {
			if err := fresh(); err != nil {
				return drainResult{}, err
			}
			return pgOutboxDrain(ctx, e, "amqp", c.backlog, c.aggregates, func(ctx context.Context, s *schema) (drainResult, error) {
				return drainToBroker(ctx, func() (*gorm.DB, error) { return s.gormDB(2) }, pub, c.backlog)
			})
		}},
		{"amqp091-go confirmed publish loop", "same messages, same headers", "amqp_client_async", func() (drainResult, error) {
			if err := fresh(); err != nil {
				return drainResult{}, err
			}
			return amqpClientLoop(ctx, conn, name, msgs)
		}},
	}
	results, err := drainRepeated(specs, c.repeat)
	if err != nil {
		return err
	}
	brokerReport(r, "amqp", fmt.Sprintf("RabbitMQ: %d events from a backlog, %d aggregates, median of %d", c.backlog, c.aggregates, c.repeat), specs, results)
	return nil
}

// amqpClientLoop publishes msgs with amqp091-go alone on a channel in
// confirm mode, mandatory and persistent with the properties and headers
// outboxamqp would set, brokerBatch at a time, and waits for each
// window's confirms.
func amqpClientLoop(ctx context.Context, conn *amqp.Connection, exchange string, msgs []outbox.Message) (drainResult, error) {
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(len(msgs)))
	defer cancel()
	ch, err := conn.Channel()
	if err != nil {
		return drainResult{}, err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return drainResult{}, err
	}
	start := time.Now()
	done := 0
	for len(msgs) > 0 {
		window := msgs[:min(brokerBatch, len(msgs))]
		msgs = msgs[len(window):]
		dcs := make([]*amqp.DeferredConfirmation, 0, len(window))
		for _, m := range window {
			h := amqp.Table{}
			for _, a := range cloudevent.Attributes(m, "") {
				if a.Name != "datacontenttype" {
					h["cloudEvents_"+a.Name] = a.Value
				}
			}
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, m.EventType, true, false, amqp.Publishing{
				Headers: h, ContentType: cloudevent.ContentType, DeliveryMode: amqp.Persistent,
				MessageId: m.EventID, Type: m.EventType, Timestamp: m.OccurredAt, Body: m.Payload,
			})
			if err != nil {
				return drainResult{}, err
			}
			dcs = append(dcs, dc)
		}
		for _, dc := range dcs {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return drainResult{done: done, elapsed: time.Since(start), timedOut: true}, nil
			}
			if ok {
				done++
			}
		}
	}
	return drainResult{done: done, elapsed: time.Since(start)}, nil
}
