package outboxotel_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxotel"
)

// exampleDB opens a fresh SQLite file with the outbox plugin, storing the
// writer's trace context with every event, and its tables.
func exampleDB() (*gorm.DB, func()) {
	dir, err := os.MkdirTemp("", "outboxotel-example")
	if err != nil {
		log.Fatal(err)
	}
	db, err := gorm.Open(sqlite.Open("file:"+filepath.Join(dir, "app.db")+"?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"),
		&gorm.Config{Logger: logger.Discard})
	if err != nil {
		log.Fatal(err)
	}
	if err := db.Use(outbox.Plugin(outbox.WithContextHeaders(outboxotel.TraceHeaders))); err != nil {
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

func ExampleTraceHeaders() {
	db, done := exampleDB()
	defer done()

	tp := sdktrace.NewTracerProvider() // the program's tracer provider
	ctx, span := tp.Tracer("shop").Start(context.Background(), "place order")
	// Written inside the span: the event stores its traceparent.
	err := outbox.Publish(db.WithContext(ctx), outbox.Event{Type: "order.placed", AggregateType: "order", AggregateID: "7"})
	span.End()
	if err != nil {
		log.Fatal(err)
	}

	var stored string
	if err := db.Raw(`SELECT headers FROM outbox_records`).Scan(&stored).Error; err != nil {
		log.Fatal(err)
	}
	var headers map[string]string
	if err := json.Unmarshal([]byte(stored), &headers); err != nil {
		log.Fatal(err)
	}
	sc := span.SpanContext()
	fmt.Println(headers["traceparent"] == fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID()))
	// Output: true
}

func ExampleWrap() {
	db, done := exampleDB()
	defer done()

	spans := tracetest.NewInMemoryExporter() // an OTLP exporter in a program
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))

	ctx, writer := tp.Tracer("shop").Start(context.Background(), "place order")
	if err := outbox.Publish(db.WithContext(ctx), outbox.Event{Type: "order.placed", AggregateType: "order", AggregateID: "7"}); err != nil {
		log.Fatal(err)
	}
	writer.End()

	broker := outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		// The headers still hold the writer's trace context, for the wire.
		fmt.Println("traceparent handed on:", b.Messages[0].Headers["traceparent"] != "")
		return nil
	})
	d, err := outbox.NewDispatcher(db, outboxotel.Wrap(broker,
		outboxotel.WithTracerProvider(tp), outboxotel.WithMessagingSystem("kafka"), outboxotel.WithDestination("orders")))
	if err != nil {
		log.Fatal(err)
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		log.Fatal(err)
	}

	for _, s := range spans.GetSpans() {
		if s.Name == "send orders" {
			fmt.Println(s.Name, s.SpanKind)
			fmt.Println("linked to the writer:", len(s.Links) == 1 && s.Links[0].SpanContext.SpanID() == writer.SpanContext().SpanID())
		}
	}
	// Output:
	// traceparent handed on: true
	// send orders producer
	// linked to the writer: true
}

func ExampleWatch() {
	db, done := exampleDB()
	defer done()

	reader := sdkmetric.NewManualReader() // a periodic OTLP reader in a program
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	d, err := outbox.NewDispatcher(db, outboxotel.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }),
		outboxotel.WithMeterProvider(mp)))
	if err != nil {
		log.Fatal(err)
	}
	reg, err := outboxotel.Watch(d, outboxotel.WithMeterProvider(mp))
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Unregister()

	if err := outbox.Publish(db, outbox.Event{Type: "order.placed", AggregateType: "order", AggregateID: "7"}); err != nil {
		log.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		log.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == "outbox_messages" {
				for _, dp := range g.DataPoints {
					if state, _ := dp.Attributes.Value("state"); dp.Value > 0 {
						fmt.Println(m.Name, state.AsString(), dp.Value)
					}
				}
			}
		}
	}
	// Output: outbox_messages pending 1
}
