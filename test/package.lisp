(defpackage #:hunchentoot-recycling-taskmaster-test
  (:use #:cl #:fiveam #:hunchentoot-recycling-taskmaster)
  (:local-nicknames (#:ht #:hunchentoot) (#:hrt #:hunchentoot-recycling-taskmaster)
                    (#:ws #:hunchentoot-recycling-websocket))
  (:export #:run-tests))
