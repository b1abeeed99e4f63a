package outboxprom_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxprom"
)

// exampleDB opens a fresh SQLite file with the outbox plugin and tables.
func exampleDB() (*gorm.DB, func()) {
	dir, err := os.MkdirTemp("", "outboxprom-example")
	if err != nil {
		log.Fatal(err)
	}
	db, err := gorm.Open(sqlite.Open("file:"+filepath.Join(dir, "app.db")+"?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"),
		&gorm.Config{Logger: logger.Discard})
	if err != nil {
		log.Fatal(err)
	}
	if err := db.Use(outbox.Plugin()); err != nil {
		log.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		log.Fatal(err)
	}
	return db, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

// printMetrics prints the counter and gauge series of reg whose names
// start with prefix, sorted, with their non-zero values.
func printMetrics(reg prometheus.Gatherer, prefix string) {
	mfs, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	var lines []string
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), prefix) {
			continue
		}
		for _, m := range mf.GetMetric() {
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
			if v == 0 {
				continue
			}
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			lines = append(lines, fmt.Sprintf("%s{%s} %v", mf.GetName(), strings.Join(labels, ","), v))
		}
	}
	sort.Strings(lines)
	fmt.Println(strings.Join(lines, "\n"))
}

func ExampleNew() {
	db, done := exampleDB()
	defer done()

	// Any publisher: here one that accepts invoices and dead-letters the rest.
	publisher := outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		failed := map[string]error{}
		for _, m := range b.Messages {
			if m.EventType != "invoice.created" {
				failed[m.EventID] = outbox.Permanent(fmt.Errorf("no route for %s", m.EventType))
			}
		}
		if len(failed) > 0 {
			return &outbox.PartialError{Failed: failed}
		}
		return nil
	})

	reg := prometheus.NewRegistry() // prometheus.DefaultRegisterer in a program
	m, err := outboxprom.New(reg)
	if err != nil {
		log.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, m.Wrap(publisher))
	if err != nil {
		log.Fatal(err)
	}
	if err := m.Watch(d); err != nil {
		log.Fatal(err)
	}

	for i, typ := range []string{"invoice.created", "invoice.created", "refund.created"} {
		if err := outbox.Publish(db, outbox.Event{Type: typ, AggregateType: "invoice", AggregateID: fmt.Sprint(i)}); err != nil {
			log.Fatal(err)
		}
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		log.Fatal(err)
	}
	printMetrics(reg, "outbox_")
	// Output:
	// outbox_messages{state="failed"} 1
	// outbox_published_total{event_type="invoice.created",outcome="accepted"} 2
	// outbox_published_total{event_type="refund.created",outcome="permanent"} 1
}

func ExampleMetrics_Watch() {
	db, done := exampleDB()
	defer done()

	reg := prometheus.NewRegistry()
	// No caching, so that the second scrape sees the dispatch at once.
	m, err := outboxprom.New(reg, outboxprom.WithStatsCacheFor(0))
	if err != nil {
		log.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error {
		return fmt.Errorf("broker down")
	})))
	if err != nil {
		log.Fatal(err)
	}
	if err := m.Watch(d); err != nil {
		log.Fatal(err)
	}
	if err := outbox.Publish(db, outbox.Event{Type: "invoice.created", AggregateType: "invoice", AggregateID: "1"}); err != nil {
		log.Fatal(err)
	}
	printMetrics(reg, "outbox_messages")
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		log.Fatal(err)
	}
	printMetrics(reg, "outbox_messages")
	// Output:
	// outbox_messages{state="pending"} 1
	// outbox_messages{state="retry"} 1
}

func ExampleMetrics_Wrap() {
	reg := prometheus.NewRegistry()
	m, err := outboxprom.New(reg)
	if err != nil {
		log.Fatal(err)
	}
	// The wrapper counts what the dispatcher will make of the error: the
	// second message is retried, the first accepted.
	p := m.Wrap(outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		return &outbox.PartialError{Failed: map[string]error{b.Messages[1].EventID: fmt.Errorf("timeout")}}
	}))
	err = p.Publish(context.Background(), outbox.Batch{ID: "b1", Messages: []outbox.Message{
		{EventID: "e1", EventType: "order.created", AggregateType: "order", AggregateID: "1"},
		{EventID: "e2", EventType: "order.created", AggregateType: "order", AggregateID: "2"},
	}})
	fmt.Println(err)
	printMetrics(reg, "outbox_published_total")
	// Output:
	// outbox: 1 message(s) not accepted; e2: timeout
	// outbox_published_total{event_type="order.created",outcome="accepted"} 1
	// outbox_published_total{event_type="order.created",outcome="retry"} 1
}
