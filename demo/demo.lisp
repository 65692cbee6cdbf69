;;;; The demo server of `make run`: PARALLEL-EASY-ACCEPTOR where an
;;;; application would have HUNCHENTOOT:EASY-ACCEPTOR.

(defpackage #:hunchentoot-recycling-taskmaster-demo
  (:use #:cl)
  (:export #:main))

(in-package #:hunchentoot-recycling-taskmaster-demo)

(hunchentoot:define-easy-handler (yo :uri "/yo") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(hunchentoot:define-easy-handler (hello :uri "/hello") ((name :init-form "world"))
  (setf (hunchentoot:content-type*) "text/plain; charset=utf-8")
  (format nil "Hello, ~A!" name))

(hunchentoot:define-easy-handler (slow :uri "/slow") ((ms :parameter-type 'integer :init-form 100))
  (setf (hunchentoot:content-type*) "text/plain")
  (sleep (/ (max 0 (min ms 10000)) 1000))
  (format nil "Slept ~D ms." ms))

(hunchentoot:define-easy-handler (stats :uri "/stats") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "~{~(~A~): ~A~%~}"
          (hunchentoot-recycling-taskmaster:taskmaster-statistics hunchentoot:*acceptor*)))

(defun static-directory ()
  (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster" "demo/static/"))

(defun main (&key (port 4242) (address "127.0.0.1"))
  "Serve the demo on ADDRESS:PORT until the process is interrupted."
  (let ((acceptor (make-instance 'hunchentoot-recycling-taskmaster:parallel-easy-acceptor
                                 :port port :address address
                                 :document-root (static-directory))))
    (hunchentoot:start acceptor)
    (format t "~&Serving http://~A:~D/ (try /yo, /hello?name=you, /slow?ms=500, /stats, /index.html). Ctrl-C stops.~%"
            address (hunchentoot:acceptor-port acceptor))
    (finish-output)
    (loop (sleep 60))))
