;;;; The replies the engine sends by itself, no handler asked: a refused
;;;; head, a body that did not arrive in time, a request that waited too
;;;; long for a worker; and the 100 Continue a client may wait for.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *head-refusals*
  '((400 "Bad Request" "The request could not be interpreted.")
    (408 "Request Timeout" "The request head did not arrive in time.")
    (411 "Length Required"
     "This server takes a request body only with a Content-Length.")
    (413 "Content Too Large" "The request body is larger than this server takes.")
    (414 "URI Too Long" "The request line is longer than 8 KiB.")
    (431 "Request Header Fields Too Large"
     "The request has too many header lines, or they are too long.")
    (500 "Internal Server Error" "The request body could not be stored.")
    (501 "Not Implemented"
     "The request's method or transfer coding is not implemented here.")
    (503 "Service Unavailable"
     "Every worker of this server was busy for too long.  Please try again later.")
    (505 "HTTP Version Not Supported" "Use HTTP/1.0 or HTTP/1.1."))
  "Every status the engine answers a request with by itself, handler unasked,
its reason phrase, and the sentence its page says.  Each is counted under
its REFUSAL-STATISTICS-KEY.")

(defun head-error-reply (status server-name retry-after-seconds &optional explanation)
  "The whole reply, status line to body, sent to a connection whose request
is refused with STATUS before it is closed: with Date and Server
(SERVER-NAME) headers, as Hunchentoot's replies have, and for 503 a
Retry-After of RETRY-AFTER-SECONDS.  A STATUS not in *HEAD-REFUSALS* has
Hunchentoot's reason phrase, and says EXPLANATION."
  (destructuring-bind (reason default-explanation) (or (rest (assoc status *head-refusals*))
                                                        (list (hunchentoot:reason-phrase status) ""))
    (let ((body (format nil "<html><head><title>~D ~A</title></head><body><h1>~A</h1><p>~A</p></body></html>"
                        status reason reason (or explanation default-explanation)))
          (crlf (coerce '(#\Return #\Linefeed) 'string)))
      (map 'octets (lambda (char) (min 255 (char-code char)))
           (format nil "HTTP/1.1 ~D ~A~ADate: ~A~AServer: ~A~A~:[~2*~;Retry-After: ~D~A~]~
                        Content-Type: text/html; charset=iso-8859-1~AContent-Length: ~D~A~
                        Connection: close~A~A~A"
                   status reason crlf (hunchentoot:rfc-1123-date) crlf server-name crlf
                   (= status 503) retry-after-seconds crlf
                   crlf (length body) crlf crlf crlf body)))))

(defparameter *continue-reply*
  (map 'octets #'char-code (format nil "HTTP/1.1 100 Continue~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed))
  "Sent before the handler runs when a request carries Expect: 100-continue,
as Hunchentoot does.")
