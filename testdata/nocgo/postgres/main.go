// Command postgres is a PostgreSQL-only program on the outbox, which
// TestSingleEngineProgramsBuildWithoutCgo builds with CGO_ENABLED=0 and
// runs against the database its argument names: it migrates, writes one
// event, delivers it and prints what it delivered.
package main

import (
	"fmt"
	"log"
	"os"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/testdata/nocgo/internal/app"
)

func main() {
	db, err := gorm.Open(postgres.Open(os.Args[1]), &gorm.Config{})
	if err != nil {
		log.Fatal(err)
	}
	out, err := app.WriteAndDeliver(db)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(out)
}
